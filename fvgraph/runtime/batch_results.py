"""The results of one batch: each request's rows of the step's outputs, and the batch tensors they view.

The graph runner hands back one StepResult per request (views of its rows, as the loop's `advance`
takes them) and keeps beside them what batch-wide work needs: the copied-out batch outputs, the
bucket, and the finite flags of the request rows, reduced on the device when the batch ran. The
finite check and the host copies then cost one operation per output, not one per request and output.
"""

from __future__ import annotations

import torch

from fvgraph.contract.plan import StepResult


class BatchResults(list):
    """One StepResult per request, in plan order (a plain list to every caller), plus the batch.

    `outputs`: the batch outputs the rows view, by name; an output that is an input passed through
    is absent (each request got its own input tensor back). `finite`: [n] bool on the outputs'
    device, whether request i's rows of every floating output in `outputs` are finite. On CUDA its
    copy to pinned host memory starts at once, so reading the flags later waits for this batch only,
    not for the batches queued behind it."""

    def __init__(self, rows: list[StepResult], outputs: dict[str, torch.Tensor], bucket: int, finite: torch.Tensor):
        super().__init__(rows)
        self.outputs = outputs
        self.bucket = bucket
        self.finite = finite
        self._host_finite, self._copied = finite, None
        if finite.device.type == "cuda":
            self._host_finite = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
            self._host_finite.copy_(finite, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def finite_flags(self) -> list[bool]:
        """The flags on the host: on CUDA this waits for the batch (and its flags' copy), no further."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host_finite.tolist()


def request_rows(out: torch.Tensor, bucket: int, n: int) -> tuple[torch.Tensor, ...]:
    """The first n requests' rows of a batch's (copied-out) output, as views: row i for request i, or
    rows i, bucket + i, ... when the output holds several rows per request branch-major (a fused-CFG
    tap). One unbind rather than n slices: this runs for every output of every batch."""
    if out.shape[0] == bucket:
        return out[:n].unsqueeze(1).unbind(0)
    return out.view(-1, bucket, *out.shape[1:])[:, :n].unbind(1)


def finite_rows(outputs: list[torch.Tensor], bucket: int, n: int) -> torch.Tensor:
    """[n] bool: whether request i's rows of every floating-point tensor in `outputs` are finite,
    reduced on their device (no host sync). Rows past n are padding and not looked at."""
    flags = torch.ones(n, dtype=torch.bool, device=outputs[0].device if outputs else "cpu")
    for out in outputs:
        if not out.is_floating_point():
            continue
        rows = out[:n] if out.shape[0] == bucket else out.view(-1, bucket, *out.shape[1:])[:, :n].transpose(0, 1)
        flags &= torch.isfinite(rows).reshape(n, -1).all(1)
    return flags
