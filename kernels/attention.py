"""One attention interface for the DiT: SDPA with a per-shape backend choice, or flashinfer when present.

(a) `sdpa_backends(seq_len, head_dim, dtype, device)` picks torch SDPA backends, in priority order, from
    a small table of measurements (below). `sdpa_backend_for(...)` is the context manager around
    `torch.nn.attention.sdpa_kernel(..., set_priority=True)` that applies the choice; it traces under
    torch.compile(fullgraph=True).
(b) `fvgraph::flashinfer_attention(q, k, v)`: non-causal attention through flashinfer's
    `single_prefill_with_kv_cache`, one call per batch entry, when flashinfer imports and the inputs are
    fp16/bf16 on CUDA; otherwise SDPA (one log line). q, k, v and the output are [B, S, H, Dh], the
    layout diffusers' WanAttnProcessor has before `dispatch_attention_fn`.
(c) `cutlass_dsl_available()`: whether the CUTLASS Python DSL (nvidia-cutlass-dsl, module `cutlass`)
    imports. No CUTLASS kernel is written yet; this is the probe a future one will check.
"""

import dataclasses
import functools
import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fvgraph.kernels._triton import optional_module

log = logging.getLogger("fvgraph.kernels")

_DEFAULT_CUDA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)


@dataclasses.dataclass(frozen=True)
class BackendRule:
    """A row of the table: on GPUs of `capability`, for these dtypes, head_dim and seq_len, use `backends`."""

    capability: tuple[int, int]  # CUDA compute capability (major, minor); (9, 0) = H100 / H200
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int
    min_seq_len: int
    backends: tuple[SDPBackend, ...]
    measured: str  # where the numbers come from


# First matching row wins; no row matches -> _DEFAULT_CUDA (flash first: the safe default below ~4k tokens).
BACKEND_TABLE = (
    BackendRule((9, 0), (torch.bfloat16, torch.float16), 128, 4096,
                (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
                "H200, torch 2.11, 14k tokens, head_dim 128, bf16: cuDNN 595 TFLOP/s vs flash 365"),
)  # fmt: skip


def sdpa_backends(seq_len: int, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> list[SDPBackend]:
    """The SDPA backends for this shape on this device, best first (all feasible ones follow as fallbacks)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]  # torch's CPU order: its flash kernel, then math
    if dtype == torch.float32:  # flash and cuDNN take fp16/bf16 only
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    for rule in BACKEND_TABLE:
        if (capability == rule.capability and dtype in rule.dtypes and head_dim <= rule.max_head_dim
                and seq_len >= rule.min_seq_len):  # fmt: skip
            return list(rule.backends)
    return list(_DEFAULT_CUDA)


@torch.compiler.assume_constant_result
def _capability(index: int) -> tuple[int, int]:
    """The GPU's compute capability; a constant to torch.compile (no graph break inside a compiled step)."""
    return torch.cuda.get_device_capability(index)


def sdpa_backend_for(seq_len: int, head_dim: int, dtype: torch.dtype, device: torch.device | str):
    """Context manager: SDPA calls inside use `sdpa_backends(...)` in that priority order."""
    return sdpa_kernel(sdpa_backends(seq_len, head_dim, dtype, device), set_priority=True)


def sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Non-causal SDPA on [B, S, H, Dh] tensors (transposed to SDPA's [B, H, S, Dh] and back)."""
    b, s, h, dh = q.shape
    with sdpa_backend_for(s, dh, q.dtype, q.device):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).contiguous()


def flashinfer_available() -> bool:
    return optional_module("flashinfer") is not None


def cutlass_dsl_available() -> bool:
    """True when the CUTLASS Python DSL (pip nvidia-cutlass-dsl: `import cutlass.cute`) imports."""
    return optional_module("cutlass.cute") is not None


@functools.cache
def _log_sdpa_fallback(why: str) -> None:
    log.warning("fvgraph::flashinfer_attention runs torch SDPA: %s", why)


@torch.library.custom_op("fvgraph::flashinfer_attention", mutates_args=())
def flashinfer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Non-causal attention, softmax scale 1/sqrt(Dh): q [B, Sq, H, Dh], k/v [B, Skv, H, Dh] -> [B, Sq, H, Dh]."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"flashinfer_attention: expected q [B, Sq, H, Dh] and k, v [B, Skv, H, Dh], got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    flashinfer = optional_module("flashinfer")
    if flashinfer is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        _log_sdpa_fallback("flashinfer is not importable" if flashinfer is None else "inputs are not fp16/bf16 on CUDA")
        return sdpa_bshd(q, k, v)
    # One single-request prefill per batch entry (B is 1-2 per CFG pair here); NHD = [S, H, Dh].
    prefill = flashinfer.single_prefill_with_kv_cache
    outs = [prefill(q[i], k[i], v[i], causal=False, kv_layout="NHD") for i in range(q.shape[0])]
    return torch.stack(outs)


@flashinfer_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """Non-causal attention on [B, S, H, Dh]: backend "sdpa" (table-chosen SDPA) or "flashinfer"."""
    if backend == "sdpa":
        return sdpa_bshd(q, k, v)
    if backend == "flashinfer":
        return torch.ops.fvgraph.flashinfer_attention(q, k, v)
    raise ValueError(f"attention: backend must be 'sdpa' or 'flashinfer', got {backend!r}")
