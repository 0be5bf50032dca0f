"""What each -O level turns on, in one frozen table (read by the engine builder, the CLI and parity).

    -O0 eager step modules, one request at a time (eager runs reuse text projections)
    -O1 every compiled step kind traced, passed and compiled; compatible steps batched across requests
    -O2 -O1 + the batches replayed as CUDA graphs (on a GPU)
    -O3 -O2 + FP8 weights and the quantize pass on the denoiser's eligible linears
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptLevel:
    level: int
    summary: str
    compiled: bool  # step kinds the loop marks compiled run as compiled graphs, batched across requests
    cuda_graphs: bool  # compiled batches are captured and replayed as CUDA graphs (CUDA devices only)
    enable_passes: tuple[str, ...] = ()  # opt-in passes (PassConfig.enabled) this level adds

    @property
    def eager(self) -> bool:
        return not self.compiled


OPT_LEVELS: dict[int, OptLevel] = {
    0: OptLevel(0, "eager", compiled=False, cuda_graphs=False),
    1: OptLevel(1, "compiled step graphs, batched", compiled=True, cuda_graphs=False),
    2: OptLevel(2, "+ CUDA graphs", compiled=True, cuda_graphs=True),
    3: OptLevel(3, "+ FP8 quantized kernels", compiled=True, cuda_graphs=True, enable_passes=("quantize",)),
}


def opt_level(level: int, field: str = "opt_level") -> OptLevel:
    """The level's config; an unknown level is an error naming the ones this build has."""
    found = OPT_LEVELS.get(level)
    if found is None:
        available = ", ".join(f"{n} ({spec.summary})" for n, spec in OPT_LEVELS.items())
        raise ValueError(f"{field}={level} is not available; this build supports {available}")
    return found


def compiling_levels() -> tuple[int, ...]:
    """The levels that compile anything (what `fvgraph warmup` accepts)."""
    return tuple(n for n, spec in OPT_LEVELS.items() if spec.compiled)
