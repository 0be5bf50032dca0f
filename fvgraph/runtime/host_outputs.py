"""Step outputs a loop reads on the host (`StepKind.host_outputs`), brought back for a whole group at once.

A loop that decides its next step from what a step returned reads a small tensor per request. Each
such output is copied in one transfer per group, so a group costs one device-to-host copy per
declared output, not one per request: from the batch tensor itself when the group ran as one batch,
else gathered over the requests on their device first. Each request then gets its own host row.
"""

from __future__ import annotations

import torch

from fvgraph.contract.plan import StepResult
from fvgraph.runtime.batch_results import BatchResults, request_rows


def copy_to_host(results: list[StepResult], names: tuple[str, ...]) -> None:
    """Replace each of `names` in every result (a [1, ...] device tensor) by its host copy, in place."""
    for name in names:
        if isinstance(results, BatchResults) and name in results.outputs:
            rows = request_rows(results.outputs[name].cpu(), results.bucket, len(results))  # one transfer
        else:
            rows = torch.cat([result[name] for result in results]).cpu().split(1)  # one transfer for the group
        for result, row in zip(results, rows):
            result[name] = row
