"""Executors: run a WorkPlan's step function, eagerly or through its compiled graph.

The eager executor is the reference every faster path is checked against, and the fallback when a
faster path is unavailable. Both run each plan on its own (batch 1), so numerics never depend on
which other requests happen to be in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from fvgraph.buckets import BucketSpec
from fvgraph.graph_runner import GraphRunner
from fvgraph.compiler import StepCompiler
from fvgraph.counters import Counters
from fvgraph.loop import StepResult, WorkPlan
from fvgraph.request_slot import RequestSlot

log = logging.getLogger(__name__)


class EagerExecutor:
    """Runs the loop's step modules (`Loop.build_steps`: one per step kind) as they are."""

    def __init__(self, steps: dict[str, nn.Module], counters: Counters):
        self.steps = steps
        self.counters = counters

    def run(self, plan: WorkPlan) -> StepResult:
        step = self.steps.get(plan.kind)
        if step is None:
            raise KeyError(f"no step function for kind {plan.kind!r}; known: {sorted(self.steps)}")
        self.counters.eager_steps += 1
        with torch.no_grad():
            return step(**plan.inputs)

    def run_batch(self, plans: list[WorkPlan], slots: list[RequestSlot], lane: int = 0) -> list[StepResult]:
        """Eager runs stay batch 1: a request's numerics never depend on its neighbours."""
        return [self.run(plan) for plan in plans]


class CompiledExecutor:
    """Runs groups of compatible plans as one padded batch through the graph runner; step kinds the
    compiler does not cover, and shapes no bucket covers, run eagerly one plan at a time."""

    def __init__(self, eager: EagerExecutor, compiler: StepCompiler, runner: GraphRunner, buckets: BucketSpec):
        self.eager = eager
        self.steps = eager.steps
        self.compiler = compiler
        self.runner = runner
        self.buckets = buckets
        self.counters = eager.counters
        self._fallback_logged: set[tuple] = set()

    def run_batch(self, plans: list[WorkPlan], slots: list[RequestSlot], lane: int = 0) -> list[StepResult]:
        """`plans` share one signature and fit the largest batch bucket; `slots` are their requests'
        runtime slots; `lane` picks the static buffers (one set per concurrent group of a signature)."""
        first = plans[0]
        if not self.compiler.wants(first.kind):
            return self.eager.run_batch(plans, slots)
        if first.pixel_shape is not None and not self.buckets.covers(*first.pixel_shape):
            self._log_fallback(first)
            self.counters.fallbacks += len(plans)
            return self.eager.run_batch(plans, slots)
        bucket = self.buckets.batch_for(len(plans))
        with torch.no_grad():
            results = self.runner.run(self.steps[first.kind], plans, slots, bucket, lane)
        self.counters.compiled_steps += len(plans)
        self.counters.batches += 1
        return results

    def prepare(self, plan: WorkPlan, on_bucket: Callable[[int], None] | None = None) -> None:
        """Compile (and capture) `plan`'s signature at every batch bucket, largest first, so the
        largest graph claims the shared memory pool and the smaller ones reuse it."""
        if not self.compiler.wants(plan.kind) or (plan.pixel_shape and not self.buckets.covers(*plan.pixel_shape)):
            return
        slot = RequestSlot()  # warmup's stand-in request: its hoisted values go with it
        with torch.no_grad():
            for bucket in reversed(self.buckets.batch_sizes):
                self.runner.run(self.steps[plan.kind], [plan] * bucket, [slot] * bucket, bucket)
                if on_bucket is not None:
                    on_bucket(bucket)

    def _log_fallback(self, plan: WorkPlan) -> None:
        key = (plan.kind, plan.pixel_shape)
        if key not in self._fallback_logged:
            self._fallback_logged.add(key)
            log.warning("no bucket covers %s at %s (frames, height, width): running it eagerly", *key)
