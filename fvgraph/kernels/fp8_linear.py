"""FP8 (e4m3) linear layers: weights quantized once per output channel, activations per row at run time.

    y = (x_q * x_scale) @ (w_q * w_scale).T + bias       x_scale [M, 1], w_scale [N], both float32

The GEMM is `torch._scaled_mm`: with rowwise scales on CUDA (cuBLASLt / CUTLASS on an H200), at unit
scales on the CPU with the scales applied to its fp32 result. So there is no Triton kernel here; the
activation quantization can be fused into the preceding norm (see norm_modulate.py), which is what
`fp8_linear_prequant` takes.

Device rules of `_scaled_mm`, handled here so callers need not:
- on CUDA, rowwise scaling only produces bf16 and the bias must be bf16: the GEMM runs with bf16 out
  (and bias) and the result is cast to the requested dtype (fp16 / fp32 callers lose nothing that the
  FP8 inputs had not already lost);
- on CUDA, K and N must be multiples of 16 (`fp8_linear_supported` says whether a weight qualifies);
- the second operand must be column-major: `w_q.t()` of the row-major [N, K] weight is exactly that.
On the CPU any float out dtype and any K, N work, so tiny test shapes run there.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# Smallest scale: an all-zero row gets this scale (so x / scale stays 0 instead of NaN).
FP8_SCALE_MIN = 1e-12
# cuBLASLt / CUTLASS FP8 GEMMs need K and N to be multiples of 16 (16-byte aligned rows).
FP8_ALIGN = 16


def fp8_linear_supported(weight: torch.Tensor) -> bool:
    """True when a [N, K] weight can run as an FP8 linear on every device (K and N multiples of 16)."""
    return weight.dim() == 2 and weight.shape[0] % FP8_ALIGN == 0 and weight.shape[1] % FP8_ALIGN == 0


def _quantize_lastdim(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric FP8 quantization along the last dim: scale = amax / 448 (>= FP8_SCALE_MIN)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_SCALE_MIN)
    # The clamp is a no-op mathematically (|x| / scale <= 448) but guards rounding: fp8 e4m3 has no inf,
    # an overflowing cast gives NaN.
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (w_q [N, K] float8_e4m3fn, w_scale [N] float32), one scale per output channel.

    Done once at load; w_q stays row-major (the GEMM reads it through `.t()`, which is column-major).
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight_fp8: weight must be [N, K], got shape {tuple(weight.shape)}")
    q, scale = _quantize_lastdim(weight.detach())
    return q.contiguous(), scale.reshape(-1).contiguous()


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] activation -> (x_q [..., K] float8_e4m3fn, x_scale [..., 1] float32), one scale per row.

    Dynamic per-token quantization: the scale follows each row's own amax, so an outlier token does not
    crush the resolution of the others.
    """
    return _quantize_lastdim(x)


def _check_operands(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
    """Shape/dtype rules, named, before `_scaled_mm` fails with a less helpful message."""
    if w_q.dtype != FP8_DTYPE or w_q.dim() != 2:
        raise ValueError(f"fp8_linear: w_fp8 must be a [N, K] {FP8_DTYPE} tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    n, k = w_q.shape
    if x_q.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has K={x_q.shape[-1]} but w_fp8 is [N={n}, K={k}]")
    if w_scale.numel() != n:
        raise ValueError(f"fp8_linear: w_scale must have N={n} entries (one per output channel), got {w_scale.numel()}")
    if x_scale.shape != (*x_q.shape[:-1], 1):
        raise ValueError(f"fp8_linear: x_scale must be {(*x_q.shape[:-1], 1)} (one per row), got {tuple(x_scale.shape)}")
    if x_q.is_cuda and not fp8_linear_supported(w_q):
        raise ValueError(f"fp8_linear: on CUDA K and N must be multiples of {FP8_ALIGN}, got N={n}, K={k}; "
                         "keep this layer in bf16 (check fp8_linear_supported(weight) first)")


def _scaled_mm_rows(x_q, x_scale, w_q, w_scale, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """The rowwise-scaled GEMM on [..., K] x [N, K] -> [..., N] in `out_dtype` (device rules above)."""
    _check_operands(x_q, x_scale, w_q, w_scale)
    lead, k, n = x_q.shape[:-1], x_q.shape[-1], w_q.shape[0]
    if not x_q.is_cuda:
        return _scaled_mm_rows_cpu(x_q.reshape(-1, k), x_scale.reshape(-1, 1), w_q, w_scale, bias, out_dtype).reshape(*lead, n)
    mm_dtype = torch.bfloat16
    y = torch._scaled_mm(
        x_q.reshape(-1, k).contiguous(),
        w_q.t(),  # column-major view of the row-major weight, as cuBLASLt wants
        scale_a=x_scale.reshape(-1, 1).float().contiguous(),
        scale_b=w_scale.reshape(1, n).float().contiguous(),
        bias=None if bias is None else bias.to(mm_dtype),
        out_dtype=mm_dtype,
    )
    return y.to(out_dtype).reshape(*lead, n)


def _scaled_mm_rows_cpu(x_q, x_scale, w_q, w_scale, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """The CPU GEMM at unit scales (fp32 accumulate), the row and channel scales applied to the fp32
    result: the same product. torch's CPU `_scaled_mm` takes per-tensor scales only before 2.13."""
    one = torch.ones((), dtype=torch.float32)
    acc = torch._scaled_mm(x_q.contiguous(), w_q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    y = acc * x_scale.float() * w_scale.reshape(1, -1).float()
    return (y if bias is None else y + bias.float()).to(out_dtype)


@torch.library.custom_op("fvgraph::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W.T + bias with W in FP8: x [..., K] is quantized per row, the output is in x.dtype."""
    x_q, x_scale = quantize_rows_fp8(x)
    return _scaled_mm_rows(x_q, x_scale, w_fp8, w_scale, bias, x.dtype)


@fp8_linear.register_fake
def _(x, w_fp8, w_scale, bias):
    return x.new_empty(*x.shape[:-1], w_fp8.shape[0])


@torch.library.custom_op("fvgraph::fp8_linear_prequant", mutates_args=())
def fp8_linear_prequant(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_linear on an activation already quantized per row (x_fp8 [..., K], x_scale [..., 1])."""
    return _scaled_mm_rows(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


@fp8_linear_prequant.register_fake
def _(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype):
    return x_fp8.new_empty(*x_fp8.shape[:-1], w_fp8.shape[0], dtype=out_dtype)


def fp8_linear_reference(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize both operands and matmul in float32: what the FP8 GEMM should compute, in fp32."""
    x = x_fp8.float() * x_scale.float()
    w = w_fp8.float() * w_scale.float().reshape(-1, 1)
    y = x @ w.t()
    return y if bias is None else y + bias.float()
