"""What the step-caching tests share: counting, per denoiser call, whether its blocks ran."""


def block_calls(transformer) -> tuple[list[bool], list]:
    """Per denoiser call, in order: whether its blocks ran (the first block's self-attention runs only
    then). Returns the list, filled as calls happen, and the hook handles to remove."""
    calls: list[bool] = []
    handles = [transformer.patch_embedding.register_forward_pre_hook(lambda m, a: calls.append(False)),
               transformer.blocks[0].attn1.register_forward_pre_hook(lambda m, a: calls.__setitem__(-1, True))]  # fmt: skip
    return calls, handles
