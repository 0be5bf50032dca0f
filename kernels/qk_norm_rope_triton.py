"""Triton kernel for fvgraph::qk_norm_rope: one program per token row of H*Dh elements.

The row is read as its even and odd halves (the rotary pairs), so the RMS statistic and the rotation
come from the same registers; one read of x, one write of the output. Imported only when Triton is
importable, or by the tests under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    S, D, HALF_DH, eps,
    cos_sb, cos_ss, sin_sb, sin_ss,  # strides of the freqs over (B, S); 0 where broadcast
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # row * D can pass 2^31 on large batches
    b = row // S
    s = row % S
    p = tl.arange(0, BLOCK_P)  # pair index over the whole row: elements 2p and 2p + 1
    mask = p < D // 2
    base = x_ptr + row * D
    x1 = tl.load(base + 2 * p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + 2 * p + 1, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.load(w_ptr + 2 * p, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + 2 * p + 1, mask=mask, other=0.0).to(tl.float32)
    # torch's rms_norm rounds x * rstd * w to x.dtype once; the rotation then reads those rounded values.
    dtype = out_ptr.dtype.element_ty
    y1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
    y2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
    j = p % HALF_DH  # the pair's index inside its head
    cos = tl.load(cos_ptr + b * cos_sb + s * cos_ss + 2 * j, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * sin_sb + s * sin_ss + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + row * D
    tl.store(out + 2 * p, (y1 * cos - y2 * sin).to(dtype), mask=mask)
    tl.store(out + 2 * p + 1, (y1 * sin + y2 * cos).to(dtype), mask=mask)


def _freq_rows(f: torch.Tensor, b: int, s: int, dh: int) -> tuple[torch.Tensor, int, int]:
    """[1 or B, S, 1, Dh] freqs as [B, S, Dh] with a unit last stride, and their (B, S) strides."""
    f = f.reshape(f.shape[0], s, dh).expand(b, s, dh)
    if f.stride(2) != 1:
        f = f.contiguous()
    return f, f.stride(0), f.stride(1)


def qk_norm_rope_triton(x, weight, freqs_cos, freqs_sin, num_heads: int, eps: float) -> torch.Tensor:
    """Launches the kernel; returns [B, S, H, Dh] in x.dtype like fvgraph::qk_norm_rope."""
    b, s, d = x.shape
    dh = d // num_heads
    x = x.contiguous()
    cos, cos_sb, cos_ss = _freq_rows(freqs_cos, b, s, dh)
    sin, sin_sb, sin_ss = _freq_rows(freqs_sin, b, s, dh)
    out = torch.empty(b, s, num_heads, dh, device=x.device, dtype=x.dtype)
    block_p = triton.next_power_of_2(d // 2)
    _qk_norm_rope_kernel[(b * s,)](
        x, weight.contiguous(), cos, sin, out, s, d, dh // 2, eps, cos_sb, cos_ss, sin_sb, sin_ss,
        BLOCK_P=block_p, num_warps=min(16, max(1, block_p // 128)),
    )  # fmt: skip
    return out
