"""The variant of an adapter step a batch runs: its plans' adapter rows narrowed to the places one
of them uses, dropped when none uses an adapter, and its adapter rows first, the low-rank work on
those alone, when only some do.

A denoise step on an engine with adapter slots takes each row's slots and scales, `lora_index` and
`lora_scale` [B, K] (fvgraph/adapters/slots.py), and every adapted linear does the low-rank work of
K places for every row it is given. A batch whose rows use at most k < K adapters each runs the step
with the first k columns (a row's used places come first, AdapterRegistry.rows), and a batch with no
adapter row runs it without the two inputs: the base step, no gather, no low-rank GEMM.

A batch where m of its rows use adapters runs them first (a stable order: requests keep their rows
from step to step), and the adapted linears do the low-rank work of the first m' rows of each branch
only, m' = m rounded up to a power of two (`SlotStore.rows_first`), so a batch of 4 with one adapter
row does one row's low-rank work; m' >= the bucket is every row. Each (width, m') is its own
ShapeSignature, so its own compiled graph at each batch bucket; `variants` lists them for warmup, so
nothing compiles while serving, whichever adapters are loaded and however batches mix. Results come
back in the caller's plan order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

from fvgraph.adapters.slots import ROW_INPUTS, SlotStore
from fvgraph.contract.plan import ShapeSignature, StepResult, WorkPlan
from fvgraph.runtime.batch_results import BatchResults

ROWS_FIRST = "adapter rows first"  # the signature fact naming m' (no input has a name with spaces)


@dataclass
class AdapterBatch:
    """A batch as it runs: `plans` in run order (adapter rows first), `order[j]` the caller's index
    of plans[j] (None: the caller's order), and m' (0: the low-rank work on every row)."""

    plans: list[WorkPlan]
    order: list[int] | None = None
    rows_first: int = 0

    def in_run_order(self, items: list) -> list:
        return items if self.order is None else [items[i] for i in self.order]


class AdapterVariants:
    """Narrows a batch's plans to the adapter places and rows its requests use; the narrowed
    signatures are kept one object per (signature, width, m'), so grouping and graph lookups match by
    identity."""

    def __init__(self) -> None:
        self._signatures: dict[tuple[ShapeSignature, int, int], ShapeSignature] = {}
        self._stores: dict[int, list[SlotStore]] = {}

    def for_batch(self, plans: list[WorkPlan], bucket: int = 1) -> AdapterBatch:
        """`plans` at the widest place count among them, adapter rows first, as a batch of `bucket`."""
        if plans[0].adapter_places is None:
            return AdapterBatch(plans)
        width = max(plan.adapter_places for plan in plans)
        users = [i for i, plan in enumerate(plans) if plan.adapter_places]
        m = _rounded(len(users), bucket) if width else 0
        if not m:
            return AdapterBatch(self.narrowed(plans, width, 0))
        order = users + [i for i, plan in enumerate(plans) if not plan.adapter_places]
        ordered = [plans[i] for i in order]
        return AdapterBatch(self.narrowed(ordered, width, m), None if order == sorted(order) else order, m)

    def variants(self, plan: WorkPlan, bucket: int = 1) -> list[WorkPlan]:
        """`plan` at every (adapter width, m') the engine may run it at in a batch of `bucket`, widest
        first (warmup prepares each)."""
        if plan.adapter_places is None:
            return [plan]
        full = plan.inputs[ROW_INPUTS[0]].shape[1]
        firsts = [1 << i for i in range(bucket.bit_length()) if 1 << i < bucket]
        return [self.narrowed([plan], width, m)[0] for width in range(full, -1, -1) for m in [0, *(firsts if width else [])]]

    @contextlib.contextmanager
    def running(self, step: nn.Module, batch: AdapterBatch, bucket: int):
        """Around a run (and the trace of its graph): the step's slot stores told its rows' layout."""
        with contextlib.ExitStack() as stack:
            if batch.rows_first:
                for store in self._slot_stores(step):
                    stack.enter_context(store.rows_first(batch.rows_first, bucket))
            yield

    def narrowed(self, plans: list[WorkPlan], width: int, m: int) -> list[WorkPlan]:
        if width >= plans[0].inputs[ROW_INPUTS[0]].shape[1] and not m:
            return plans
        out = []
        for plan in plans:
            inputs = {name: t for name, t in plan.inputs.items() if name not in ROW_INPUTS}
            if width:
                inputs.update({name: plan.inputs[name][:, :width] for name in ROW_INPUTS})
            out.append(WorkPlan(plan.request_id, plan.kind, inputs, plan.step_index, plan.pixel_shape,
                                self._signature(plan.signature, width, m, inputs), min(plan.adapter_places, width)))  # fmt: skip
        return out

    def _signature(self, signature: ShapeSignature, width: int, m: int, inputs: dict) -> ShapeSignature:
        key = (signature, width, m)
        found = self._signatures.get(key)
        if found is None:
            found = ShapeSignature.of(signature.kind, inputs)
            if m:
                found = ShapeSignature(found.kind, (*found.inputs, (ROWS_FIRST, (m,), "rows")))
            self._signatures[key] = found
        return found

    def _slot_stores(self, step: nn.Module) -> list[SlotStore]:
        found = self._stores.get(id(step))
        if found is None:
            found = self._stores[id(step)] = [m for m in step.modules() if isinstance(m, SlotStore)]
        return found


def rows_first_of(signature: ShapeSignature) -> int:
    """The m' a narrowed signature runs its adapter rows' low-rank work on (0: every row)."""
    return next((shape[0] for name, shape, _ in signature.inputs if name == ROWS_FIRST), 0)


def in_caller_order(results: list[StepResult], order: list[int] | None) -> list[StepResult]:
    """A batch's results (results[j] is the caller's plan order[j]) in the caller's plan order."""
    if order is None:
        return results
    position = [0] * len(order)
    for j, i in enumerate(order):
        position[i] = j
    if isinstance(results, BatchResults):
        return results.reordered(position)
    return [results[j] for j in position]


def _rounded(m: int, bucket: int) -> int:
    """m adapter rows as the signature's m': the next power of two, 0 (every row) when that fills the bucket."""
    rounded = 1 << (m - 1).bit_length() if m else 0
    return rounded if rounded < bucket else 0
