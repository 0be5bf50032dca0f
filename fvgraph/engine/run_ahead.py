"""Running ahead: the host prepares batch N+1 while the device runs batch N.

Serially (the reference, and the default off CUDA) a group runs, its outputs are read back (the
finite flags, a host sync on CUDA), its requests advance, and only then is the next group planned
and its inputs copied. Running ahead, a group is launched and its requests advance at once on the
device tensors it returned; the next group is launched too (within a tick) or planned and staged
into its static buffers (the next tick's first group: `GraphRunner.stage`), and only then are the
launched group's flags read and its requests settled: failures, timings, on_step. A tick planned
ahead is committed only after that settle; when the settle or `before_commit` changed the scheduler
(a failed row, a cancel, an arrival) the tick is planned again, so no row is stale or lost and every
result equals the serial order's.

Settled at once, as serially: a kind with HOST outputs or one that `continues` (the loop decides
its next step from them), every group while warming up, and every group of a tick given `on_result`,
which must see a result before its request advances, and only a finite one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fvgraph.contract.loop import LoopState
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.engine.fold_back import advance_ahead, settle
from fvgraph.runtime.scheduler import Group, Tick


@dataclass
class Launched:
    """A group whose batch was launched and whose requests advanced, not yet settled."""

    members: list[tuple[LoopState, WorkPlan]]
    results: list[StepResult]
    elapsed: float
    compiled_for_it: float
    advanced: dict[int, Exception]  # requests whose outputs did not fold back, by position
    on_step: Callable | None


class RunAhead:
    """The engine's run-ahead order. Reads the engine's `run_ahead`, `before_commit`, `_launched`,
    `_scheduler`, `_slots`, `executor`, `counters`, `loop`, `_warming`, `_retry_alone` and `_fail`; it runs
    inside a tick, under the engine's math mode."""

    def _ahead(self, on_result: Callable | None) -> bool:
        return self.run_ahead and on_result is None and self._warming is None

    def _runs_ahead(self, group: Group) -> bool:
        kind = self.loop.step_kinds[group.members[0][1].kind]
        return not kind.host_outputs and not kind.continues

    def _planned_ahead(self) -> Tick:
        """The next tick, its first group staged before the group launched last is settled; planned
        again when that settle or `before_commit` changed the scheduler."""
        tick = self._scheduler.plan()
        if tick.groups and self._runs_ahead(tick.groups[0]):
            self._stage(tick.groups[0])
        if self.before_commit is not None:
            self.before_commit()
        self._settle_launched()
        if tick.version != self._scheduler.version:
            tick = self._scheduler.plan()  # the batch run() replays is filled again where it changed
        return self._scheduler.commit(tick)

    def _stage(self, group: Group) -> None:
        try:
            self.executor.stage([plan for _, plan in group.members], [self._slots.of(s) for s, _ in group.members], group.lane)
        except Exception:  # the group's run reports it, member by member (Engine._run_group)
            pass

    def _launch_ahead(self, group: Group, on_step: Callable | None) -> None:
        """Launch `group` and advance its requests, then settle the group launched before it."""
        members = group.members
        plans, slots = [plan for _, plan in members], [self._slots.of(state) for state, _ in members]
        began, compile_seconds = time.perf_counter(), self.counters.compile_seconds
        try:
            results = self.executor.run_batch(plans, slots, group.lane)
        except Exception as err:  # settle what is launched, then as serially: the group retried alone
            self._settle_launched()
            self._fail(self._retry_alone(members, on_step, None, err))
            return
        compiled_for_it = self.counters.compile_seconds - compile_seconds
        elapsed = time.perf_counter() - began - compiled_for_it
        launched = Launched(members, results, elapsed, compiled_for_it, advance_ahead(self.loop, members, results), on_step)
        self._settle_launched()
        self._launched = launched

    def _settle_launched(self) -> None:
        """Read the launched group's flags and settle its requests (nothing when none is launched)."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._fail(settle(self.loop, launched.members, launched.results, launched.advanced, launched.elapsed,
                              launched.compiled_for_it, launched.on_step))  # fmt: skip
