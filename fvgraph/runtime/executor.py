"""Executors: run a WorkPlan's step function, eagerly or through its compiled graph.

The eager executor is the reference every faster path is checked against, and the fallback when a
faster path is unavailable. It runs each plan on its own (batch 1), so numerics never depend on which
other requests happen to be in flight, unless it is given batch buckets (`padded`): then compatible
plans run as one padded batch, as the compiled executor runs them, which is how the parity diff
measures an eager side's batch-composition noise floor (fvgraph/parity.py).

Both run a batch of adapter steps at the narrowest adapter width its rows use, without adapter rows
when none uses one (fvgraph/runtime/adapter_variant.py).

With offload both executors run each group inside `residency.around(kind)`: the components the kind
reads are on the device while it runs (fvgraph/runtime/component_residency.py), or the block groups it
copies are counted (fvgraph/runtime/block_streaming.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from fvgraph.runtime.adapter_variant import AdapterBatch, AdapterVariants, in_caller_order, rows_first_of
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.runtime.batch_results import request_rows
from fvgraph.runtime.block_streaming import BlockStreaming
from fvgraph.runtime.component_residency import ComponentResidency
from fvgraph.runtime.graph_runner import GraphRunner
from fvgraph.compile.compiler import StepCompiler
from fvgraph.contract.counters import Counters
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.runtime.request_slot import RequestSlot

log = logging.getLogger(__name__)


class EagerExecutor:
    """Runs the loop's step modules (`Loop.build_steps`: one per step kind) as they are."""

    # What the engine reads of any executor (this one, CompiledExecutor, ParallelExecutor): the step
    # compiler (None: nothing compiles), why it takes no more work (None: it does), and close().
    compiler: StepCompiler | None = None
    unavailable: str | None = None

    def close(self) -> None:
        """Release what the executor holds beyond memory (nothing, here)."""

    def __init__(self, steps: dict[str, nn.Module], counters: Counters, padded: BucketSpec | None = None,
                 residency: ComponentResidency | BlockStreaming | None = None):  # fmt: skip
        self.steps = steps
        self.counters = counters
        self.padded = padded  # None: one plan at a time; buckets: compatible plans as one padded batch
        self.residency = residency  # offload (None: every component stays on the device)
        self.adapter_variants = AdapterVariants()

    def resident(self, kind: str) -> contextlib.AbstractContextManager:
        """Around a group of `kind`: its components on the device (component offload), else nothing."""
        return contextlib.nullcontext() if self.residency is None else self.residency.around(kind)

    def run(self, plan: WorkPlan) -> StepResult:
        step = self.steps.get(plan.kind)
        if step is None:
            raise KeyError(f"no step function for kind {plan.kind!r}; known: {sorted(self.steps)}")
        self.counters.eager_steps += 1
        [plan] = self.adapter_variants.for_batch([plan]).plans
        with torch.no_grad():
            return step(**plan.inputs)

    def run_batch(self, plans: list[WorkPlan], slots: list[RequestSlot], lane: int = 0) -> list[StepResult]:
        """Batch 1 per plan (a request's numerics never depend on its neighbours), or with `padded`
        one batch padded with zero rows up to its bucket, each plan getting its rows of every output."""
        with self.resident(plans[0].kind):
            return self._run_batch(plans)

    def _run_batch(self, plans: list[WorkPlan]) -> list[StepResult]:
        if self.padded is None or len(plans) == 1 and self.padded.batch_for(1) == 1:
            return [self.run(plan) for plan in plans]
        step = self.steps[plans[0].kind]
        bucket = self.padded.batch_for(len(plans))
        batch = self.adapter_variants.for_batch(plans, bucket)
        plans = batch.plans
        inputs = {name: _padded_rows([plan.inputs[name] for plan in plans], bucket) for name in plans[0].inputs}
        self.counters.eager_steps += len(plans)
        with torch.no_grad(), self.adapter_variants.running(step, batch, bucket):
            outputs = step(**inputs)
        rows = {name: request_rows(out, bucket, len(plans)) for name, out in outputs.items()}
        return in_caller_order([{name: rows[name][i] for name in outputs} for i in range(len(plans))], batch.order)


def _padded_rows(tensors: list[torch.Tensor], bucket: int) -> torch.Tensor:
    """The plans' batch-1 tensors stacked, then zero rows up to `bucket` (the graph runner's padding)."""
    batch = torch.cat(tensors, dim=0)
    if batch.shape[0] == bucket:
        return batch
    return torch.cat([batch, batch.new_zeros(bucket - batch.shape[0], *batch.shape[1:])], dim=0)


class CompiledExecutor:
    """Runs groups of compatible plans as one padded batch through the graph runner; step kinds the
    compiler does not cover, and shapes no bucket covers, run eagerly one plan at a time."""

    unavailable: str | None = None

    def close(self) -> None:
        pass

    def __init__(self, eager: EagerExecutor, compiler: StepCompiler, runner: GraphRunner, buckets: BucketSpec):
        self.eager = eager
        self.steps = eager.steps
        self.compiler = compiler
        self.runner = runner
        self.buckets = buckets
        self.counters = eager.counters
        self._fallback_logged: set[tuple] = set()
        self._graph_shapes: set[tuple[int, int, int]] = set()  # shapes given graphs when BucketSpec.shapes is None

    def run_batch(self, plans: list[WorkPlan], slots: list[RequestSlot], lane: int = 0) -> list[StepResult]:
        """`plans` share one signature and fit the largest batch bucket; `slots` are their requests'
        runtime slots; `lane` picks the static buffers (one set per concurrent group of a signature)."""
        first = plans[0]
        if not self.compiler.wants(first.kind):
            return self.eager.run_batch(plans, slots)
        if first.pixel_shape is not None and not self._has_graphs(first.pixel_shape):
            self._log_fallback(first)
            self.counters.fallbacks += len(plans)
            return self.eager.run_batch(plans, slots)
        bucket = self.buckets.batch_for(len(plans))
        batch = self.eager.adapter_variants.for_batch(plans, bucket)
        step = self.steps[first.kind]
        with torch.no_grad(), self.eager.resident(first.kind), self.eager.adapter_variants.running(step, batch, bucket):
            results = self.runner.run(step, batch.plans, batch.in_run_order(slots), bucket, lane)
        self.counters.compiled_steps += len(plans)
        self.counters.batches += 1
        return in_caller_order(results, batch.order)

    def prepare(self, plan: WorkPlan, on_bucket: Callable[[int], None] | None = None) -> None:
        """Compile (and capture) `plan`'s signature at every batch bucket, largest first, so the
        largest graph claims the shared memory pool and the smaller ones reuse it; an adapter step at
        each adapter width a batch may run it at."""
        if not self.compiler.wants(plan.kind) or (plan.pixel_shape and not self._has_graphs(plan.pixel_shape)):
            return
        with torch.no_grad(), self.eager.resident(plan.kind):
            variants = self.eager.adapter_variants
            for bucket in reversed(self.buckets.batch_sizes):
                for variant in variants.variants(plan, bucket):
                    slot = RequestSlot()  # warmup's stand-in request, one per bucket: every bucket's prologue runs
                    batch = AdapterBatch([variant] * bucket, rows_first=rows_first_of(variant.signature))
                    with variants.running(self.steps[plan.kind], batch, bucket):
                        self.runner.run(self.steps[plan.kind], batch.plans, [slot] * bucket, bucket)
                if on_bucket is not None:
                    on_bucket(bucket)

    def _has_graphs(self, pixel_shape: tuple[int, int, int]) -> bool:
        """Whether this shape runs through compiled graphs: a listed shape, or (no list) one of the
        first `max_shapes` distinct shapes seen, so compiled memory stays bounded."""
        if self.buckets.shapes is not None:
            return self.buckets.covers(*pixel_shape)
        if pixel_shape not in self._graph_shapes and len(self._graph_shapes) < self.buckets.max_shapes:
            self._graph_shapes.add(pixel_shape)
        return pixel_shape in self._graph_shapes

    def _log_fallback(self, plan: WorkPlan) -> None:
        key = (plan.kind, plan.pixel_shape)
        if key not in self._fallback_logged:
            self._fallback_logged.add(key)
            why = "no bucket covers" if self.buckets.shapes is not None else \
                f"max_shapes={self.buckets.max_shapes} shapes already have graphs; not compiling"
            log.warning("%s %s at %s (frames, height, width): running it eagerly", why, *key)
