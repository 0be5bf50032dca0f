"""Whether a step's outputs are finite: garbage (NaN, Inf) must fail its request, not come back ok.

A batch from the graph runner carries its requests' flags, reduced on the device inside the compiled
step (passes/finite_flags.py, fvgraph/runtime/batch_results.py); reading them is the group's one host
sync. Results of the eager path, one per plan, are reduced tensor by tensor on their device and read
together.
"""

from __future__ import annotations

import torch

from fvgraph.contract.plan import StepResult
from fvgraph.runtime.batch_results import BatchResults


def all_finite(results: list[StepResult]) -> list[bool]:
    """Per result: True when every floating-point output holds only finite values."""
    if isinstance(results, BatchResults):
        return results.finite_flags()
    if not results:
        return []
    flags = []
    for result in results:
        checks = [torch.isfinite(t).all() for t in result.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not checks:
            flags.append(torch.ones((), dtype=torch.bool))
            continue
        device = checks[0].device
        flags.append(torch.stack([c.to(device) for c in checks]).all())
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).tolist()
