"""Capture one CUDA graph into a shared memory pool, and leave the process usable when that fails.

A capture fails when the captured region does something a graph cannot hold (a host sync, a read of
a device value, an op that is not capture-safe). torch.cuda.graph's exit then raises from
`capture_end` before the caching allocator stops routing the capture stream's allocations to the
pool, and before it leaves the capture stream (torch 2.11). Left like that, every later capture into
the same pool is refused ("already recording to mempool_id") and the current stream stays the
capture stream. `capture_graph` undoes both, gives back the pool's use the failed capture took, and
raises CaptureError naming the error that broke the capture (the one `capture_end` only reacts to).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """A CUDA graph capture failed; the stream and the allocator are back as they were before it."""


def capture_graph(fn: Callable, args: Sequence[torch.Tensor], pool) -> tuple[object, tuple[torch.Tensor, ...]]:
    """Warm `fn(*args)` up twice on a side stream, then capture one call into `pool`.
    Returns (graph, its static outputs); raises CaptureError after cleaning up."""
    previous = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(previous)
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # the first call may allocate workspaces or pick kernels; neither may be captured
            fn(*args)
    previous.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
            outputs = tuple(fn(*args))
    except Exception as err:
        _recover(previous, pool)
        cause = err.__context__ or err.__cause__
        detail = f"{err!r}" + (f", caused by {cause!r}" if cause is not None else "")
        raise CaptureError(f"CUDA graph capture failed: {detail}") from err
    return graph, outputs


def _recover(previous, pool) -> None:
    """Leave the capture stream, stop allocating into `pool`, and release the failed capture's use of it."""
    torch.cuda.set_stream(previous)
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:  # capture_end got as far as ending the routing itself, and owns the pool's release
        return
    torch._C._cuda_releasePool(device, pool)
