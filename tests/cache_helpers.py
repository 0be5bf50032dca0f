"""What the step-caching tests share: counting, per denoiser call, whether its blocks ran."""


def block_calls(transformer) -> tuple[list[bool], list]:
    """Per denoiser call, in order: whether its blocks ran (the first block's self-attention runs only
    then). Returns the list, filled as calls happen, and the hook handles to remove."""
    calls: list[bool] = []
    handles = [transformer.patch_embedding.register_forward_pre_hook(lambda m, a: calls.append(False)),
               transformer.blocks[0].attn1.register_forward_pre_hook(lambda m, a: calls.__setitem__(-1, True))]  # fmt: skip
    return calls, handles


def run_together_and_alone(engine, requests) -> list:
    """The interleave gate: `requests` run in one engine together, each result equal, bit for bit, to
    the request run alone (latents and what its caching did). Returns the results run together."""
    import torch

    together = engine.generate(requests)
    for request, result in zip(requests, together):
        [alone] = engine.generate([request])
        assert result.ok and alone.ok, (result.error, alone.error)
        assert torch.equal(result.latents, alone.latents), request.request_id
        assert result.cache == alone.cache
    return together


def flux_block_calls(transformer) -> tuple[list[bool], list]:
    """FLUX's `block_calls`: whether each denoiser call's last block computed (a cache hook replaces a
    skipped block's forward, so the block's own call still happens)."""
    calls: list[bool] = []
    handles = [transformer.x_embedder.register_forward_pre_hook(lambda m, a: calls.append(False)),
               transformer.single_transformer_blocks[-1].attn.register_forward_pre_hook(lambda m, a: calls.__setitem__(-1, True))]  # fmt: skip
    return calls, handles


def run_recording_blocks(engine, request, fbcache: bool):
    """`request` run alone on a FLUX engine, and per denoiser call whether its blocks ran: FBCache's
    from the kind of each step's second launch (one letter per branch), the other methods' from the
    blocks' own calls."""
    from fvgraph.caching.fb_cache_steps import AFTER_FIRST_KINDS

    calls, handles = flux_block_calls(engine.loop.components.transformer)
    decided: list[bool] = []

    def record(state, plan, result):
        if plan.kind in AFTER_FIRST_KINDS.values():
            decided.extend(letter == "c" for letter in plan.kind.rsplit("_", 1)[1])

    try:
        [result] = engine.generate([request], on_result=record)
    finally:
        for handle in handles:
            handle.remove()
    assert result.ok, result.error
    return result, decided if fbcache else calls
