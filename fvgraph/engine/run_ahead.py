"""Running ahead: the device never waits for the host between two batches.

Serially (the reference, and the default off CUDA) a group runs, its outputs are read back (the
finite flags, a host sync on CUDA), its requests advance, and only then is the next group planned
and its inputs copied. Running ahead, a group is launched and its requests advance at once on the
device tensors it returned; the next group is launched too, within a tick, and across ticks the
next tick is planned and its first group launched (`_planned_ahead`: on CUDA its copies and replay queue
behind the batch still running) before the launched group's flags are read and its requests settled:
failures, timings, on_step. So the device always has the next batch queued while the host reads one
back. A tick planned ahead is committed only after that settle; when the settle or `before_commit`
changed the scheduler (a failed row, a cancel, an arrival) the tick is planned again, and a launched
first group that is no longer the new plan's first group is dropped unread (its requests never
advanced on it) and run again (`counters.batches_redone`). An arrival that joins a later lane leaves
the first group as it was, so under load an arrival costs nothing; when it joins the first group
(fewer requests running than the largest bucket) that batch runs twice. Every result equals the
serial order's.

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


@dataclass
class GroupRun:
    """A group's batch, run, its requests not advanced yet: the next tick's first group is run so
    before that tick is committed (the engine's `_early`), every other group just before it advances."""

    group: Group
    results: list[StepResult] | None
    error: Exception | None  # what its run raised
    elapsed: float
    compiled_for_it: float


def _same_group(a: Group, b: Group) -> bool:
    """The same requests with the same plans (each loop is asked once a round) in the same rows and lane."""
    return a.lane == b.lane and len(a.members) == len(b.members) and all(
        x[0] is y[0] and x[1] is y[1] for x, y in zip(a.members, b.members))  # fmt: skip


class RunAhead:
    """The engine's run-ahead order. Reads the engine's `run_ahead`, `before_commit`, `_launched`, `_early`,
    `_scheduler`, `_slots`, `executor`, `counters`, `loop`, `_warming`, `_prepare`, `_retry_alone` and
    `_fail`; it runs inside a tick, under the engine's math mode."""

    def _ahead(self, on_result: Callable | None) -> bool:
        return self.run_ahead and on_result is None and self._warming is None

    def _runs_ahead(self, group: Group) -> bool:
        kind = self.loop.step_kinds[group.members[0][1].kind]
        return not kind.host_outputs and not kind.continues

    def _planned_ahead(self) -> Tick:
        """The next tick, its first group launched before the group launched last is settled; planned
        again when that settle or `before_commit` changed the scheduler, the early launch kept only
        when the new plan's first group is the one it ran."""
        tick = self._scheduler.plan()
        early = self._run_batch_of(tick.groups[0]) if tick.groups and self._runs_ahead(tick.groups[0]) else None
        if self.before_commit is not None:
            self.before_commit()
        self._settle_launched()
        if tick.version != self._scheduler.version:
            tick = self._scheduler.plan()
            if early is not None and tick.groups and _same_group(tick.groups[0], early.group):
                early.group = tick.groups[0]  # the new plan's first group is the one it ran
            elif early is not None:
                early = None  # dropped unread: its requests did not advance on it, and its group runs anew
                self.counters.batches_redone += 1
        self._early = early
        return self._scheduler.commit(tick)

    def _run_batch_of(self, group: Group) -> GroupRun:
        """Run `group`'s batch now, its requests not advanced yet (serially too: Engine._run_group);
        an error is kept for whoever advances the group, which retries it member by member."""
        plans, slots = [plan for _, plan in group.members], [self._slots.of(state) for state, _ in group.members]
        began, compile_seconds = time.perf_counter(), self.counters.compile_seconds
        try:
            if self._warming is not None:  # warming up runs serially: each signature compiled first
                self._prepare(plans[0])
            results, error = self.executor.run_batch(plans, slots, group.lane), None  # under the tick's math mode
        except Exception as err:  # one request's failure must not take the others down
            results, error = None, err
        compiled_for_it = self.counters.compile_seconds - compile_seconds
        return GroupRun(group, results, error, time.perf_counter() - began - compiled_for_it, compiled_for_it)

    def _launch_ahead(self, group: Group, on_step: Callable | None) -> None:
        """Launch `group` (or take its early launch) and advance its requests, then settle the group
        launched before it."""
        run, self._early = self._early, None
        if run is None or run.group is not group:
            if run is not None:  # a tick cut short left it: dropped unread, like one a new plan no longer has
                self.counters.batches_redone += 1
            run = self._run_batch_of(group)
        if run.error is not None:  # settle what is launched, then as serially: the group retried alone
            self._settle_launched()
            self._fail(self._retry_alone(group.members, on_step, None, run.error))
            return
        advanced = advance_ahead(self.loop, group.members, run.results)
        launched = Launched(group.members, run.results, run.elapsed, run.compiled_for_it, advanced, on_step)
        self._settle_launched()
        self._launched = launched

    def _settle_launched(self) -> None:
        """Read the launched group's flags and settle its requests (nothing when none is launched)."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._fail(settle(self.loop, launched.members, launched.results, launched.advanced, launched.elapsed,
                              launched.compiled_for_it, launched.on_step))  # fmt: skip
