"""The variant of an adapter step a batch runs: its plans' adapter rows narrowed to the places one
of them uses, or dropped when none uses an adapter.

A denoise step on an engine with adapter slots takes each row's slots and scales, `lora_index` and
`lora_scale` [B, K] (fvgraph/adapters/slots.py), and every adapted linear does the low-rank work of
K places for every row it is given. A batch whose rows use at most k < K adapters each runs the step
with the first k columns (a row's used places come first, AdapterRegistry.rows), and a batch with no
adapter row runs it without the two inputs: the base step, no gather, no low-rank GEMM. Each width
is its own ShapeSignature, so its own compiled graph at each batch bucket; `variants` lists them for
warmup, so no width compiles while serving, whichever adapters are loaded.
"""

from __future__ import annotations

from fvgraph.adapters.slots import ROW_INPUTS
from fvgraph.contract.plan import ShapeSignature, WorkPlan


class AdapterVariants:
    """Narrows a batch's plans to the adapter places its rows use; the narrowed signatures are kept
    one object per (signature, width), so grouping and graph lookups match by identity."""

    def __init__(self) -> None:
        self._signatures: dict[tuple[ShapeSignature, int], ShapeSignature] = {}

    def for_batch(self, plans: list[WorkPlan]) -> list[WorkPlan]:
        """`plans` with their adapter rows narrowed to the widest place count among them."""
        if plans[0].adapter_places is None:
            return plans
        return self.narrowed(plans, max(plan.adapter_places for plan in plans))

    def variants(self, plan: WorkPlan) -> list[WorkPlan]:
        """`plan` at every adapter width the engine may run it at, widest first (warmup prepares each)."""
        if plan.adapter_places is None:
            return [plan]
        full = plan.inputs[ROW_INPUTS[0]].shape[1]
        return [self.narrowed([plan], width)[0] for width in range(full, -1, -1)]

    def narrowed(self, plans: list[WorkPlan], width: int) -> list[WorkPlan]:
        if width >= plans[0].inputs[ROW_INPUTS[0]].shape[1]:
            return plans
        out = []
        for plan in plans:
            inputs = {name: t for name, t in plan.inputs.items() if name not in ROW_INPUTS}
            if width:
                inputs.update({name: plan.inputs[name][:, :width] for name in ROW_INPUTS})
            out.append(WorkPlan(plan.request_id, plan.kind, inputs, plan.step_index, plan.pixel_shape,
                                self._signature(plan.signature, width, inputs), min(plan.adapter_places, width)))  # fmt: skip
        return out

    def _signature(self, signature: ShapeSignature, width: int, inputs: dict) -> ShapeSignature:
        key = (signature, width)
        found = self._signatures.get(key)
        if found is None:
            found = self._signatures[key] = ShapeSignature.of(signature.kind, inputs)
        return found
