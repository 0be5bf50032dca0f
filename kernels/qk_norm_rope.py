"""Wan's query/key prologue fused: RMSNorm over the whole inner dim (with weight) + rotary embedding.

diffusers' WanAttnProcessor does, for q and for k (x = to_q(h) or to_k(h), [B, S, H*Dh]):

    x = attn.norm_q(x)                      # torch.nn.RMSNorm(H*Dh, eps, elementwise_affine=True)
    x = x.unflatten(2, (H, -1))             # [B, S, H, Dh]
    x = apply_rotary_emb(x, freqs_cos, freqs_sin)

with freqs_cos / freqs_sin float32 [1, S, 1, Dh] from WanRotaryPosEmbed, each frequency repeated for
an interleaved (even, odd) pair: out[2i] = x[2i] cos - x[2i+1] sin, out[2i+1] = x[2i] sin + x[2i+1] cos,
using cos = freqs_cos[..., 0::2] and sin = freqs_sin[..., 1::2]. That is 4+ memory passes in eager;
the Triton kernel (qk_norm_rope_triton.py) does one, and rounds where diffusers rounds: the normed
value to x.dtype (torch's rms_norm computes x * rstd * weight in fp32 and rounds once), then the
rotation in fp32, rounded to x.dtype.

Op: fvgraph::qk_norm_rope(x [B, S, H*Dh], weight [H*Dh], freqs_cos, freqs_sin, num_heads, eps)
    -> [B, S, H, Dh] in x.dtype, contiguous: the layout the processor hands to attention next.
"""

import torch
import torch.nn.functional as F

from fvgraph.kernels._triton import use_triton


def _check(x: torch.Tensor, weight: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, num_heads: int):
    """x [B, S, H*Dh]; weight [H*Dh]; freqs [1 or B, S, 1, Dh] with an even Dh."""
    if x.dim() != 3 or num_heads <= 0 or x.shape[-1] % num_heads:
        raise ValueError(f"qk_norm_rope: x must be [B, S, num_heads*head_dim], got {tuple(x.shape)} "
                         f"with num_heads={num_heads}")
    b, s, d = x.shape
    dh = d // num_heads
    if dh % 2:
        raise ValueError(f"qk_norm_rope: head_dim must be even for interleaved rotary pairs, got {dh}")
    if weight.shape != (d,):
        raise ValueError(f"qk_norm_rope: weight must be [{d}] (RMSNorm over heads*head_dim), got {tuple(weight.shape)}")
    for name, f in (("freqs_cos", freqs_cos), ("freqs_sin", freqs_sin)):
        if f.dim() != 4 or f.shape[1:] != (s, 1, dh) or f.shape[0] not in (1, b):
            raise ValueError(f"qk_norm_rope: {name} must be [1 or {b}, {s}, 1, {dh}] (WanRotaryPosEmbed's output), "
                             f"got {tuple(f.shape)}")


def apply_rotary_emb_wan(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' WanAttnProcessor.apply_rotary_emb, verbatim: [B, S, H, Dh] with interleaved pairs."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def qk_norm_rope_reference(x, weight, freqs_cos, freqs_sin, num_heads: int, eps: float) -> torch.Tensor:
    """The torch reference: exactly diffusers' norm_q + unflatten + apply_rotary_emb."""
    normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return apply_rotary_emb_wan(normed.unflatten(2, (num_heads, -1)), freqs_cos, freqs_sin)


@torch.library.custom_op("fvgraph::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    freqs_cos: torch.Tensor,
    freqs_sin: torch.Tensor,
    num_heads: int,
    eps: float,
) -> torch.Tensor:
    """RMSNorm(x) * weight, split into heads, rotated: [B, S, H*Dh] -> [B, S, H, Dh] in x.dtype."""
    _check(x, weight, freqs_cos, freqs_sin, num_heads)
    if use_triton("qk_norm_rope", x, weight, freqs_cos, freqs_sin):
        from fvgraph.kernels.qk_norm_rope_triton import qk_norm_rope_triton

        return qk_norm_rope_triton(x, weight, freqs_cos, freqs_sin, num_heads, eps)
    return qk_norm_rope_reference(x, weight, freqs_cos, freqs_sin, num_heads, eps).contiguous()


@qk_norm_rope.register_fake
def _(x, weight, freqs_cos, freqs_sin, num_heads, eps):
    b, s, d = x.shape
    return x.new_empty(b, s, num_heads, d // num_heads)
