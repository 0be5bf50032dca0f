"""Whether a step's outputs are finite: garbage (NaN, Inf) must fail its request, not come back ok.

Each output is reduced on its own device (`isfinite().all()`, one small kernel) and the whole group's
flags are read back together at the step boundary, so a group costs one host sync, not one per tensor.
"""

from __future__ import annotations

import torch

from fvgraph.contract.plan import StepResult


def all_finite(results: list[StepResult]) -> list[bool]:
    """Per result: True when every floating-point output holds only finite values."""
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
