"""Step outputs a loop reads on the host (`StepKind.host_outputs`), brought back for a whole group at once.

A loop that decides its next step from what a step returned reads a small tensor per request. Each
such output is gathered over the group's requests on its device and copied in one transfer, so a
group costs one device-to-host copy per declared output, not one per request; each request then
gets its own host row.
"""

from __future__ import annotations

import torch

from fvgraph.contract.plan import StepResult


def copy_to_host(results: list[StepResult], names: tuple[str, ...]) -> None:
    """Replace each of `names` in every result (a [1, ...] device tensor) by its host copy, in place."""
    for name in names:
        rows = torch.cat([result[name] for result in results]).cpu()  # one transfer for the group
        for result, row in zip(results, rows.split(1)):
            result[name] = row
