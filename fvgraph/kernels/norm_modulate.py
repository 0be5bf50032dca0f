"""The DiT block prologue fused with FP8 row quantization: LayerNorm (no affine) + adaptive modulation + quantize.

Wan's transformer block computes, before self-attention and before the FFN,

    norm = (layer_norm(h.float(), eps) * (1 + scale) + shift).type_as(h)

with shift / scale float32 of shape [B, 1, D] (Wan 2.1, one per sample) or [B, S, D] (Wan 2.2, one per
token). `fvgraph::norm_modulate_quant` computes it and the FP8 row quantization of the fp32 value in one
pass (one program per row, the whole row in registers, fp32 statistics), so the q/k/v (or FFN-up) FP8
linears that follow (`fvgraph::fp8_linear_prequant`) get their activation quantization for free. Its
runtime caller is the -O3 quantize pass (passes/quantize.py). Without a quantized user inductor fuses
the plain prologue itself, so there is no unquantized op.

On CUDA with Triton importable the op runs the kernel in norm_modulate_triton.py; otherwise the torch
reference below (one log line when a CUDA caller has no Triton).
"""

import torch
import torch.nn.functional as F

from fvgraph.kernels._triton import use_triton
from fvgraph.kernels.fp8_linear import FP8_DTYPE, quantize_rows_fp8


def _check(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> None:
    """x is [B, S, D]; shift and scale broadcast to it ([B, 1, D], [B, S, D], [1, 1, D] ...)."""
    if x.dim() != 3:
        raise ValueError(f"norm_modulate_quant: x must be [B, S, D], got shape {tuple(x.shape)}")
    for name, t in (("shift", shift), ("scale", scale)):
        try:
            torch.broadcast_shapes(t.shape, x.shape)
        except RuntimeError:
            raise ValueError(f"norm_modulate_quant: {name} of shape {tuple(t.shape)} does not broadcast to x {tuple(x.shape)}; "
                             "expected [B, 1, D] or [B, S, D]") from None
        if t.dim() != 3:
            raise ValueError(f"norm_modulate_quant: {name} must be 3-d ([B, 1, D] or [B, S, D]), got shape {tuple(t.shape)}")


def modulated_fp32(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """layer_norm(x.float()) * (1 + scale) + shift in float32, exactly as diffusers' WanTransformerBlock."""
    norm = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return norm * (1 + scale.float()) + shift.float()


def norm_modulate_quant_reference(x, shift, scale, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of fvgraph::norm_modulate_quant: FP8 row quantization of the fp32 value."""
    return quantize_rows_fp8(modulated_fp32(x, shift, scale, eps))


@torch.library.custom_op("fvgraph::norm_modulate_quant", mutates_args=())
def norm_modulate_quant(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x) * (1 + scale) + shift) quantized to FP8 per row: (x_fp8 [B, S, D] float8_e4m3fn,
    x_scale [B, S, 1] float32); x [B, S, D], statistics and the modulated value in fp32."""
    _check(x, shift, scale)
    if use_triton("norm_modulate_quant", x, shift, scale):
        from fvgraph.kernels.norm_modulate_triton import norm_modulate_quant_triton

        return norm_modulate_quant_triton(x, shift, scale, eps)
    x_q, x_scale = norm_modulate_quant_reference(x, shift, scale, eps)
    return x_q.contiguous(), x_scale.contiguous()


@norm_modulate_quant.register_fake
def _(x, shift, scale, eps):
    b, s, d = x.shape
    return x.new_empty(b, s, d, dtype=FP8_DTYPE), x.new_empty(b, s, 1, dtype=torch.float32)
