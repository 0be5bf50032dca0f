"""The SDPA backend choice for the DiT's self-attention: torch SDPA, backends in a per-shape priority.

`sdpa_backends(seq_len, head_dim, dtype, device)` picks torch SDPA backends, in priority order, from a
small table (below). The compiler asks `sdpa_backends` for each step whose denoiser declares its
attention shape, compiles the step under `torch.nn.attention.sdpa_kernel(those, set_priority=True)`
and names the choice in the step's signature (fvgraph/compile/compiler.py). `sdpa_backend_for(...)`
returns that same context for a shape (it traces under torch.compile(fullgraph=True)); the kernel
benchmark (perf/bench_kernels.py) times each backend through it. fvgraph has no attention kernel of its own.
"""

import dataclasses

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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
# The rows are anchor measurements of torch SDPA itself, measured outside the project on an H200 (torch
# 2.11.0+cu130, bf16, a standalone probe script, 2026-11-29: each backend timed alone at 14040 tokens,
# 12 heads x 128), not measurements of an fvgraph run; perf/bench_kernels.py --gpu re-measures
# SDPA per backend at the Wan shapes (`sdpa_table` is this choice).
BACKEND_TABLE = (
    BackendRule((9, 0), (torch.bfloat16, torch.float16), 128, 4096,
                (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
                "anchor measurement of SDPA alone outside the project, H200, torch 2.11.0+cu130, 14040 tokens, 12 heads x 128, bf16: "
                "cuDNN 595 TFLOP/s vs flash 365"),
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
