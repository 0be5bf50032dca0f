"""What an fp32 card means for torch's global math switches: IEEE fp32 products, not TF32.

torch turns TF32 on for cuDNN convolutions by default (cuBLAS matmuls default to IEEE, unless the
process changed that). A TF32 convolution rounds its inputs to 10 mantissa bits, so two fp32 runs
whose latents differ by one ulp can round an input to different TF32 values and differ by ~1e-4
after Wan's patch-embedding Conv3d: a jump, not a drift. The -O2 vs -O0 parity check on an H200
(perf/results/2026-11-30-h200.jsonl) showed jumps of that kind (block 0 of one request went from
1e-7 to 6e-5 apart in a single step, with its input latents 2e-7 apart).

The engine holds `math_mode(precision)` around each call that runs, compiles or captures steps
(each tick, `generate` across its ticks, `step`, warmup's compiles; the algorithm a captured
convolution uses is fixed at capture), callbacks included, and gives the caller's settings back
after. Once per call, not once per batch: reading and writing torch's switches goes through torch.backends' Python properties,
which cost tens of microseconds when they run once between two steps. The context is reentrant, so
a step run from inside a held call (warmup compiling as it serves) costs a counter. Other precisions
leave the switches as they are.
"""

from __future__ import annotations

import contextlib

import torch


_MIXED_APIS = (
    "fp32 math: this process set TF32 through torch's fp32_precision API (torch.backends.cuda.matmul."
    "fp32_precision or torch.backends.cudnn.conv.fp32_precision), and fvgraph's fp32 context "
    "(fvgraph/runtime/tf32_switch.py) reads and sets torch.backends.*.allow_tf32, which torch then refuses. "
    "For an fp32 card, leave TF32 unset in this process or set it with allow_tf32 only (torch said: {err})"
)


class Fp32Math:
    """TF32 off for cuDNN and cuBLAS while inside; the previous settings restored when the outermost
    entry exits (an inner entry only counts)."""

    def __init__(self) -> None:
        self._depth = 0
        self._saved = None

    def __enter__(self) -> None:
        if self._depth == 0:
            backends = torch.backends
            try:
                self._saved = (backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32)
                backends.cudnn.allow_tf32 = False
                backends.cuda.matmul.allow_tf32 = False
            except RuntimeError as err:  # torch refuses the legacy switches once the new API set TF32
                raise RuntimeError(_MIXED_APIS.format(err=err)) from err
        self._depth += 1

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self._saved


def math_mode(precision: str) -> contextlib.AbstractContextManager:
    """The context steps of this precision run in (reusable and reentrant)."""
    return Fp32Math() if precision == "fp32" else contextlib.nullcontext()
