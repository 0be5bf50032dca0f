"""The results of one batch: each request's rows of the step's outputs, and the batch tensors they view.

The graph runner hands back one StepResult per request (views of its rows, as the loop's `advance`
takes them) and keeps beside them what batch-wide work needs: the copied-out batch outputs, the
bucket, and the step's finite flags, reduced on the device inside the step. The finite check
then costs one small host read per batch, and the host copies one operation per output, not one per
request and output.
"""

from __future__ import annotations

import torch

from fvgraph.contract.plan import StepResult


class BatchResults(list):
    """One StepResult per request, in plan order (a plain list to every caller), plus the batch.

    `outputs`: the batch outputs the rows view, by name; an output that is an input passed through
    is absent (each request got its own input tensor back). `flags`: [bucket] bool, the step's
    finite flags (passes/finite_flags.py), computed on the device when the batch ran; rows past the
    n requests are padding and never read. On CUDA their copy to pinned host memory starts at once
    (a graph's flags are a static output the next replay overwrites, and this copy is queued before
    it), so reading them later waits for this batch only, not for the batches queued behind it."""

    def __init__(self, rows: list[StepResult], outputs: dict[str, torch.Tensor], flags: torch.Tensor):
        super().__init__(rows)
        self.outputs = outputs
        self.bucket = flags.shape[0]
        self._host_flags, self._copied = flags, None
        self._positions: list[int] | None = None  # request i's row (reordered); None: row i
        if flags.device.type == "cuda":
            self._host_flags = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            self._host_flags.copy_(flags, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def finite_flags(self) -> list[bool]:
        """The requests' flags on the host: on CUDA this waits for the batch (and its flags' copy), no further."""
        if self._copied is not None:
            self._copied.synchronize()
        flags = self._host_flags.tolist()
        return [flags[j] for j in self._positions] if self._positions is not None else flags[: len(self)]

    def reordered(self, positions: list[int]) -> BatchResults:
        """The same results for requests that ran at other rows: request i's is row positions[i]. The
        batch outputs are left out (their rows are in run order), so host reads go row by row."""
        out = BatchResults.__new__(BatchResults)
        list.__init__(out, [self[j] for j in positions])
        out.outputs, out.bucket = {}, self.bucket
        out._host_flags, out._copied, out._positions = self._host_flags, self._copied, positions
        return out


def request_rows(out: torch.Tensor, bucket: int, n: int) -> tuple[torch.Tensor, ...]:
    """The first n requests' rows of a batch's (copied-out) output, as views: row i for request i, or
    rows i, bucket + i, ... when the output holds several rows per request branch-major (a fused-CFG
    tap). One split rather than n slices: this runs for every output of every batch."""
    if out.shape[0] == bucket:
        return out.split_with_sizes([1] * n if n == bucket else [*[1] * n, bucket - n])[:n]
    return out.view(-1, bucket, *out.shape[1:])[:, :n].unbind(1)
