"""Triton kernel for fvgraph::norm_modulate_quant: one program per row, the whole row in registers.

Imported only when Triton is importable (fvgraph.kernels.norm_modulate decides), or by the tests, which
run it on the CPU under TRITON_INTERPRET=1. Reads x once, shift and scale once, writes the output once:
the memory-bound minimum. D up to 5120 (Wan-14B) fits one BLOCK_D = next_power_of_2(D) <= 8192 block.
"""

import torch
import triton
import triton.language as tl

from fvgraph.kernels.fp8_linear import FP8_DTYPE, FP8_MAX, FP8_SCALE_MIN


@triton.jit
def _round_to_e4m3_grid(v):
    """Rounds fp32 |v| <= 448 to the nearest e4m3 value (ties to even), still as fp32.

    The cast that follows is then exact. Why not just cast: Triton 3.7's interpreter converts fp32 to
    fp8 without carrying a mantissa round-up into the exponent (31.1 -> 16 instead of 32), so the tests
    could not check the kernel on a CPU; this rounding is exact on both, for a few ALU ops in a
    memory-bound kernel. Adding c = 1.5 * 2^(e + 20) puts |v| in a binade whose ulp is |v|'s e4m3 ulp
    2^(e - 3) (e clamped at -6: e4m3 subnormals share the spacing 2^-9), and IEEE addition rounds it.
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    c = (((e + 20) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    a = tl.abs(v)
    r = (a + c) - c
    return tl.where(v < 0, -r, r)


@triton.jit
def _norm_modulate_kernel(
    x_ptr, shift_ptr, scale_ptr, out_ptr, qscale_ptr,
    S, D, eps,
    shift_sb, shift_ss, scale_sb, scale_ss,  # strides of shift / scale over (B, S); 0 where broadcast
    FP8_MAX_C: tl.constexpr, SCALE_MIN: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # row * D passes 2^31 at batch 8 of 720p video
    b = row // S
    s = row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    # LayerNorm statistics in fp32, two-pass over registers (no E[x^2] - E[x]^2 cancellation).
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / D
    norm = xc * (1.0 / tl.sqrt(var + eps))
    shift = tl.load(shift_ptr + b * shift_sb + s * shift_ss + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * scale_sb + s * scale_ss + cols, mask=mask, other=0.0).to(tl.float32)
    y = norm * (1.0 + scale) + shift
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
    qscale = tl.maximum(amax / FP8_MAX_C, SCALE_MIN)
    # div_rn: IEEE division like torch's (Triton's `/` is approximate), so both round the same value.
    q = _round_to_e4m3_grid(tl.minimum(tl.maximum(tl.div_rn(y, qscale), -FP8_MAX_C), FP8_MAX_C))
    tl.store(out_ptr + row * D + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(qscale_ptr + row, qscale)


def _row_strides(t: torch.Tensor, b: int, s: int, d: int) -> tuple[torch.Tensor, int, int]:
    """t broadcast to [B, S, D] with a unit stride on D; returns it and its (B, S) strides (0 = broadcast)."""
    t = t.expand(b, s, d)
    if t.stride(2) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def norm_modulate_quant_triton(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel; returns what fvgraph::norm_modulate_quant returns: (x_fp8, x_scale [B, S, 1])."""
    b, s, d = x.shape
    x = x.contiguous()
    shift, shift_sb, shift_ss = _row_strides(shift, b, s, d)
    scale, scale_sb, scale_ss = _row_strides(scale, b, s, d)
    out = torch.empty(b, s, d, device=x.device, dtype=FP8_DTYPE)
    qscale = torch.empty(b, s, 1, device=x.device, dtype=torch.float32)
    block_d = triton.next_power_of_2(d)
    _norm_modulate_kernel[(b * s,)](
        x, shift, scale, out, qscale, s, d, eps, shift_sb, shift_ss, scale_sb, scale_ss,
        FP8_MAX_C=FP8_MAX, SCALE_MIN=FP8_SCALE_MIN, BLOCK_D=block_d, num_warps=min(16, max(1, block_d // 256)),
    )  # fmt: skip
    return out, qscale
