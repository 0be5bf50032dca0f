"""Running ahead: the device never waits for the host between two batches.

Serially (the reference, and the default off CUDA) a group runs, its outputs are read back (the
finite flags, a host sync on CUDA), its requests advance, and only then is the next group planned
and its inputs copied. Running ahead, a group is launched and its requests advance at once on the
device tensors it returned; the next group is launched too, within a tick, and across ticks the
next tick is planned and its first group launched (`planned_ahead`: on CUDA its copies and replay queue
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

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from fvgraph.contract.counters import Counters
from fvgraph.contract.loop import Loop, LoopState
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.engine.fold_back import ResultCallback, StepCallback, advance_ahead, fold_back, settle
from fvgraph.runtime.executor import CompiledExecutor, EagerExecutor
from fvgraph.runtime.request_slot import RequestSlots
from fvgraph.runtime.scheduler import Group, Scheduler, Tick

log = logging.getLogger(__name__)

Fail = Callable[[list[tuple[LoopState, Exception]]], None]  # ends the requests whose step failed


@dataclass
class Launched:
    """A group whose batch was launched and whose requests advanced, not yet settled."""

    members: list[tuple[LoopState, WorkPlan]]
    results: list[StepResult]
    elapsed: float
    compiled_for_it: float
    advanced: dict[int, Exception]  # requests whose outputs did not fold back, by position
    on_step: StepCallback | None


@dataclass
class GroupRun:
    """A group's batch, run, its requests not advanced yet: the next tick's first group is run so
    before that tick is committed (RunAhead.early), every other group just before it advances."""

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
    """Runs a tick's groups in the serial order or running ahead, and holds the batch launched and not
    yet settled. Handed the loop (step kinds, advance), the scheduler (a tick planned, then committed),
    the request slots and the executor (a batch run), the counters, and `fail`: the engine's end for
    requests whose step failed. It runs inside a tick, under the engine's math mode."""

    def __init__(self, loop: Loop, scheduler: Scheduler, slots: RequestSlots, executor: EagerExecutor | CompiledExecutor,
                 counters: Counters, fail: Fail, enabled: bool):  # fmt: skip
        self._loop, self._scheduler, self._slots, self._executor = loop, scheduler, slots, executor
        self._counters, self._fail = counters, fail
        self.enabled = enabled  # the engine's `run_ahead`
        # Called once per tick before it is committed; running ahead, after its first batch was launched.
        self.before_commit: Callable[[], None] | None = None
        self.launched: Launched | None = None  # launched and advanced, not yet settled
        self.early: GroupRun | None = None  # the committed tick's first group, launched before the commit
        self._prepare: Callable[[WorkPlan], None] | None = None  # while warming up: a signature prepared first

    @contextmanager
    def warming(self, prepare: Callable[[WorkPlan], None]):
        """While warmup serves its requests: every group runs serially, `prepare` called on its first
        plan before its batch runs (each signature compiled at every bucket first)."""
        self._prepare = prepare
        try:
            yield
        finally:
            self._prepare = None

    def tick_runs_ahead(self, on_result: ResultCallback | None) -> bool:
        return self.enabled and on_result is None and self._prepare is None

    def runs_ahead(self, group: Group) -> bool:
        kind = self._loop.step_kinds[group.members[0][1].kind]
        return not kind.host_outputs and not kind.continues

    def planned_ahead(self) -> Tick:
        """The next tick, its first group launched before the group launched last is settled; planned
        again when that settle or `before_commit` changed the scheduler, the early launch kept only
        when the new plan's first group is the one it ran."""
        scheduler = self._scheduler
        tick = scheduler.plan()
        early = self.run_batch_of(tick.groups[0]) if tick.groups and self.runs_ahead(tick.groups[0]) else None
        if self.before_commit is not None:
            self.before_commit()
        self.settle_launched()
        if tick.version != scheduler.version:
            tick = scheduler.plan()
            if early is not None and tick.groups and _same_group(tick.groups[0], early.group):
                early.group = tick.groups[0]  # the new plan's first group is the one it ran
            elif early is not None:
                early = None  # dropped unread: its requests did not advance on it, and its group runs anew
                self._counters.batches_redone += 1
        self.early = early
        return scheduler.commit(tick)

    def run_batch_of(self, group: Group) -> GroupRun:
        """Run `group`'s batch now, its requests not advanced yet (serially too: run_group); an error is
        kept for whoever advances the group, which retries it member by member."""
        plans, slots = [plan for _, plan in group.members], [self._slots.of(state) for state, _ in group.members]
        began, compile_seconds = time.perf_counter(), self._counters.compile_seconds
        try:
            if self._prepare is not None:  # warming up runs serially: each signature compiled first
                self._prepare(plans[0])
            results, error = self._executor.run_batch(plans, slots, group.lane), None  # under the tick's math mode
        except Exception as err:  # one request's failure must not take the others down
            results, error = None, err
        compiled_for_it = self._counters.compile_seconds - compile_seconds
        return GroupRun(group, results, error, time.perf_counter() - began - compiled_for_it, compiled_for_it)

    def run_group(self, group: list[tuple[LoopState, WorkPlan]], on_step: StepCallback | None,
                  on_result: ResultCallback | None = None, lane: int = 0) -> list[tuple]:  # fmt: skip
        """The serial order: run one group and fold the results back; returns the (state, error) pairs
        that failed."""
        run = self.run_batch_of(Group(group, lane))
        if run.error is not None:
            return self._retry_alone(group, on_step, on_result, run.error)
        return fold_back(self._loop, group, run.results, run.elapsed, run.compiled_for_it, on_step, on_result)

    def _retry_alone(self, group: list[tuple[LoopState, WorkPlan]], on_step: StepCallback | None,
                     on_result: ResultCallback | None, err: Exception) -> list[tuple]:  # fmt: skip
        """A group whose batch raised: each member run alone, so only the request at fault fails."""
        if len(group) > 1:
            return [failure for member in group for failure in self.run_group([member], on_step, on_result)]
        state, plan = group[0]
        log.exception("request %s failed at %s step %d", state.request_id, plan.kind, plan.step_index, exc_info=err)
        return [(state, err)]

    def launch_ahead(self, group: Group, on_step: StepCallback | None) -> None:
        """Launch `group` (or take its early launch) and advance its requests, then settle the group
        launched before it."""
        run, self.early = self.early, None
        if run is None or run.group is not group:
            if run is not None:  # a tick cut short left it: dropped unread, like one a new plan no longer has
                self._counters.batches_redone += 1
            run = self.run_batch_of(group)
        if run.error is not None:  # settle what is launched, then as serially: the group retried alone
            self.settle_launched()
            self._fail(self._retry_alone(group.members, on_step, None, run.error))
            return
        advanced = advance_ahead(self._loop, group.members, run.results)
        launched = Launched(group.members, run.results, run.elapsed, run.compiled_for_it, advanced, on_step)
        self.settle_launched()
        self.launched = launched

    def settle_launched(self) -> None:
        """Read the launched group's flags and settle its requests (nothing when none is launched)."""
        launched, self.launched = self.launched, None
        if launched is not None:
            self._fail(settle(self._loop, launched.members, launched.results, launched.advanced, launched.elapsed,
                             launched.compiled_for_it, launched.on_step))  # fmt: skip

    def drop(self) -> None:
        """Forget what is launched, unread: its requests were abandoned, their results dropped with them."""
        self.launched = self.early = None
