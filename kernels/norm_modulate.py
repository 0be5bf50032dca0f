"""The DiT block prologue: LayerNorm (no affine) + adaptive modulation, optionally + FP8 row quantization.

Wan's transformer block computes, before self-attention and before the FFN,

    norm = (layer_norm(h.float(), eps) * (1 + scale) + shift).type_as(h)

with shift / scale float32 of shape [B, 1, D] (Wan 2.1, one per sample) or [B, S, D] (Wan 2.2, one per
token). In eager that is ~6 memory passes over [B, S, D]; the Triton kernel does it in one (one program
per row, the whole row in registers, fp32 statistics). `norm_modulate_quant` also emits the FP8 row
quantization of the modulated value in the same pass, so the q/k/v (or FFN-up) FP8 linears that follow
(`fvgraph::fp8_linear_prequant`) get their activation quantization for free.

On CUDA with Triton importable the ops run the kernel in norm_modulate_triton.py; otherwise the torch
reference below (one log line when a CUDA caller has no Triton).
"""

import torch
import torch.nn.functional as F

from fvgraph.kernels._triton import use_triton
from fvgraph.kernels.fp8_linear import FP8_DTYPE, quantize_rows_fp8


def _check(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> None:
    """x is [B, S, D]; shift and scale broadcast to it ([B, 1, D], [B, S, D], [1, 1, D] ...)."""
    if x.dim() != 3:
        raise ValueError(f"norm_modulate: x must be [B, S, D], got shape {tuple(x.shape)}")
    for name, t in (("shift", shift), ("scale", scale)):
        try:
            torch.broadcast_shapes(t.shape, x.shape)
        except RuntimeError:
            raise ValueError(f"norm_modulate: {name} of shape {tuple(t.shape)} does not broadcast to x {tuple(x.shape)}; "
                             "expected [B, 1, D] or [B, S, D]") from None
        if t.dim() != 3:
            raise ValueError(f"norm_modulate: {name} must be 3-d ([B, 1, D] or [B, S, D]), got shape {tuple(t.shape)}")


def modulated_fp32(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """layer_norm(x.float()) * (1 + scale) + shift in float32, exactly as diffusers' WanTransformerBlock."""
    norm = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return norm * (1 + scale.float()) + shift.float()


def norm_modulate_reference(x, shift, scale, eps: float) -> torch.Tensor:
    """The torch reference of fvgraph::norm_modulate."""
    return modulated_fp32(x, shift, scale, eps).to(x.dtype)


def norm_modulate_quant_reference(x, shift, scale, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of fvgraph::norm_modulate_quant: FP8 row quantization of the fp32 value."""
    return quantize_rows_fp8(modulated_fp32(x, shift, scale, eps))


@torch.library.custom_op("fvgraph::norm_modulate", mutates_args=())
def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """(layer_norm(x) * (1 + scale) + shift) in x.dtype, x [B, S, D], statistics in fp32."""
    _check(x, shift, scale)
    if use_triton("norm_modulate", x, shift, scale):
        from fvgraph.kernels.norm_modulate_triton import norm_modulate_triton

        return norm_modulate_triton(x, shift, scale, eps)
    return norm_modulate_reference(x, shift, scale, eps).contiguous()  # the fake promises contiguous


@norm_modulate.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fvgraph::norm_modulate_quant", mutates_args=())
def norm_modulate_quant(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_modulate quantized to FP8 per row: (x_fp8 [B, S, D] float8_e4m3fn, x_scale [B, S, 1] float32)."""
    _check(x, shift, scale)
    if use_triton("norm_modulate_quant", x, shift, scale):
        from fvgraph.kernels.norm_modulate_triton import norm_modulate_triton

        return norm_modulate_triton(x, shift, scale, eps, quant=True)
    x_q, x_scale = norm_modulate_quant_reference(x, shift, scale, eps)
    return x_q.contiguous(), x_scale.contiguous()


@norm_modulate_quant.register_fake
def _(x, shift, scale, eps):
    b, s, d = x.shape
    return x.new_empty(b, s, d, dtype=FP8_DTYPE), x.new_empty(b, s, 1, dtype=torch.float32)
