"""FLOPs of a step, counted once per signature with torch.utils.flop_counter on fake tensors.

A step-caching method reports how much work it avoided: the FLOPs of the steps a request ran against
those of the uncached step at every step. `StepFlops.count(kind, inputs)` runs the step module once
on the meta device inside `FlopCounterMode` (shapes only: no arithmetic, no memory) and keeps the
total per `ShapeSignature`, so each (kind, input shapes) is counted once per engine, not per call.
The step modules it runs are built on `meta_twin`s of the denoiser: the same class, config and
parameter dtypes with no data, so the counting never calls the serving modules (their hooks, the
eager projection cache) and allocates nothing.

What is counted is what the flop counter counts (fvgraph/contract/flops.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from fvgraph.contract.flops import flop_counter
from fvgraph.contract.plan import ShapeSignature


def meta_twin(module: nn.Module) -> nn.Module:
    """A data-free copy of a diffusers model: `from_config` on the meta device, each parameter and
    buffer in the dtype of the original's (modules diffusers keeps in fp32 stay fp32)."""
    with torch.device("meta"):
        twin = type(module).from_config(module.config)
    dtypes = {name: t.dtype for name, t in (*module.named_parameters(), *module.named_buffers())}
    for name, t in (*twin.named_parameters(), *twin.named_buffers()):
        if name in dtypes and t.dtype != dtypes[name]:
            t.data = t.data.to(dtypes[name])
    return twin.eval().requires_grad_(False)


class StepFlops:
    """FLOPs per step kind and input shapes, counted on first use; `steps` are step modules built on
    a `meta_twin` of the denoiser."""

    def __init__(self, steps: Mapping[str, nn.Module]):
        self.steps = steps
        self._counted: dict[ShapeSignature, int] = {}

    def count(self, kind: str, inputs: Mapping[str, torch.Tensor]) -> int:
        """FLOPs of one call of step `kind` on `inputs` (batch as given)."""
        key = ShapeSignature(kind, tuple((n, tuple(t.shape), str(t.dtype)) for n, t in sorted(inputs.items())))
        if key not in self._counted:
            meta = {name: t.to("meta") for name, t in inputs.items()}
            with flop_counter() as counter, torch.no_grad():
                self.steps[kind](**meta)
            self._counted[key] = int(counter.get_total_flops())
        return self._counted[key]
