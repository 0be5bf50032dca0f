"""ParallelExecutor: rank 0's executor of a parallel engine.

For a step kind the plan splits, it hands the worker ranks the call (fvgraph/parallel/workers.py),
makes the same call on its own executor (eager or compiled: the same code as one process), and waits
for the workers' answers. Kinds that do not touch a denoiser run on rank 0 alone. A kind the plan
cannot split is refused by name, before any rank starts it.
"""

from __future__ import annotations

from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.parallel.workers import WorkerGroup, WorkersLost
from fvgraph.runtime.request_slot import RequestSlot


class ParallelExecutor:
    def __init__(self, local, group: WorkerGroup, split: set[str], refused: set[str]):
        self.local = local  # the EagerExecutor or CompiledExecutor every rank runs
        self.group = group
        self.split = split
        self.refused = refused
        self.steps = local.steps
        self.counters = local.counters
        self.compiler = local.compiler

    @property
    def unavailable(self) -> str | None:
        """Why this executor takes no more work (a lost worker, closed), or None."""
        return self.group.lost

    def run_batch(self, plans: list[WorkPlan], slots: list[RequestSlot], lane: int = 0) -> list[StepResult]:
        kind = plans[0].kind
        if self.group.lost is not None:
            raise WorkersLost(f"{self.group.lost}; this engine's parallel group is gone and it takes no more "
                              "work: start a new engine")  # fmt: skip
        if kind in self.refused:
            raise ValueError(f"step kind {kind!r} has no parallel plan (ParallelConfig splits only the plain "
                             "denoise steps): run requests that need it on an engine without `parallel`")  # fmt: skip
        if kind not in self.split:
            return self.local.run_batch(plans, slots, lane)
        frozen = self.compiler is not None and self.compiler.frozen
        self.group.send_run(kind, plans, slots, lane, frozen)
        try:
            results = self.local.run_batch(plans, slots, lane)
        except Exception:
            self.group.check_alive(f"a {kind} step")  # a collective failed because a worker died: say so
            try:
                self.group.collect(kind, grace=True)  # keep the ranks in step before this error goes up
            except WorkersLost:
                raise
            except RuntimeError:
                pass  # the workers failed the same call: rank 0's own error says why
            raise
        self.group.collect(kind)
        return results

    def close(self) -> None:
        self.group.close()
