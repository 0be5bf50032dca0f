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
