"""The scheduler: which requests run this tick, and which of their steps run together.

Each tick: admit waiting requests FIFO while there is room (running requests always keep their
place), drop cancelled ones at the step boundary, ask every running loop for its next WorkPlan (a
request that finished or failed hands its place to the next waiting one in the same tick), and
group the plans that can share one graph: same step kind and same shapes past the batch dim. A group
larger than the biggest batch bucket is split into lanes. Requests at different timesteps, with different
guidance scales, seeds and step counts fall into one group: those are [B] tensors, not shapes. A step
whose kind `continues` (the first launch of a step its loop splits in two) has its request's next
step grouped again in the same tick (`continue_within_tick`), once the engine ran it.

With component offload (fvgraph/runtime/residency_order.py) an `order` holds back the groups whose
components are not resident, for a bounded number of ticks, so requests at different stages do not
move components back and forth every tick.

`tick()` is `commit(plan())`: `plan` works the tick out without changing the scheduler, so an engine
running ahead (fvgraph/engine/run_ahead.py) can plan and stage the next tick before the last batch
is settled, and plan it again when a submit, cancel or failure came in between (`version`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.contract.loop import Loop, LoopState
from fvgraph.contract.plan import Done, WorkPlan
from fvgraph.runtime.residency_order import ResidentFirst


@dataclass
class Group:
    """Compatible steps that run as one batch. `lane` numbers the groups of one signature in a tick:
    each lane keeps its own static buffers, so two groups of one signature do not overwrite each
    other's rows every step."""

    members: list[tuple[LoopState, WorkPlan]]
    lane: int = 0


@dataclass
class Tick:
    finished: list[LoopState] = field(default_factory=list)
    cancelled: list[LoopState] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    failed: list[tuple[LoopState, Exception]] = field(default_factory=list)  # their loop could not plan a step
    held: list[Group] = field(default_factory=list)  # groups the order holds back this tick (they run later)
    # What the scheduler holds once the tick is committed, and its version when the tick was planned.
    running: list[LoopState] = field(default_factory=list)
    waiting: deque[LoopState] = field(default_factory=deque)
    version: int = 0


class Scheduler:
    def __init__(self, loop: Loop, buckets: BucketSpec, max_running: int, order: ResidentFirst | None = None):
        if max_running < 1:
            raise ValueError(f"max_running={max_running} must be at least 1")
        self.loop = loop
        self.buckets = buckets
        self.max_running = max_running
        self.order = order  # ResidentFirst under component offload; None: every group runs each tick
        self.waiting: deque[LoopState] = deque()
        self.running: list[LoopState] = []
        self.cancel_requested: set[str] = set()
        # Bumped by every change from outside a tick (a submit, a cancel, a removal): a tick planned
        # ahead at an older version must be planned again before it is committed.
        self.version = 0
        # This round's answers of next(), by id(state); the state is held so its id cannot be reused.
        self._asked: dict[int, tuple[LoopState, WorkPlan | Done | Exception]] = {}

    def submit(self, state: LoopState) -> None:
        self.waiting.append(state)
        self.version += 1

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step boundary; the other requests are not disturbed."""
        self.cancel_requested.add(request_id)
        self.version += 1

    def ended(self, request_id: str) -> None:
        """The request has its result: a cancel asked for it no longer applies (its id may come again)."""
        self.cancel_requested.discard(request_id)
        self.version += 1

    def abandon(self, ids: set[str]) -> None:
        """Drop these requests wherever they are, waiting or running, and forget their cancels."""
        self.waiting = deque(s for s in self.waiting if s.request_id not in ids)
        self.remove([s for s in self.running if s.request_id in ids])
        self.cancel_requested -= ids

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, gone: list[LoopState]) -> None:
        """Take these requests out of the running list. Each hole is filled by the last running request
        rather than closed up, so every other request keeps its place, and with it its row in the
        batch (the graph runner then refills only the rows whose request changed)."""
        self.running = _without(self.running, gone)
        self.version += 1

    def tick(self) -> Tick:
        return self.commit(self.plan())

    def plan(self) -> Tick:
        """What a tick does now, changing nothing: cancels dropped, waiting requests admitted FIFO while
        there is room, every running loop's next step, grouped. Each loop is asked once per round
        (`next` is asked again only after the tick is committed), so a tick planned ahead of a change
        can be planned again."""
        tick, running, waiting = Tick(version=self.version), list(self.running), deque(self.waiting)
        if self.cancel_requested:
            tick.cancelled = [s for s in waiting if s.request_id in self.cancel_requested]
            waiting = deque(s for s in waiting if s.request_id not in self.cancel_requested)
            running_cancelled = [s for s in running if s.request_id in self.cancel_requested]
            running = _without(running, running_cancelled)
            tick.cancelled += running_cancelled
        while waiting and len(running) < self.max_running:
            running.append(waiting.popleft())
        members = [(state, self._next(state)) for state in running]
        if not all(isinstance(plan, WorkPlan) for _, plan in members):
            # A request whose loop cannot go on fails alone, the tick goes on; a finished one leaves.
            tick.failed = [(state, plan) for state, plan in members if isinstance(plan, Exception)]
            tick.finished = [state for state, plan in members if isinstance(plan, Done)]
            running = self._leave(running, tick, waiting)
            members = [(state, self._asked[id(state)][1]) for state in running]
        tick.running, tick.waiting = running, waiting
        tick.groups = self._grouped(members)
        if self.order is not None:
            tick.groups, tick.held = self.order.arrange(tick.groups)
        return tick

    def commit(self, tick: Tick) -> Tick:
        """Make `tick` (planned at the current version) the scheduler's state; the next round asks anew."""
        if tick.version != self.version:
            raise RuntimeError(f"a tick planned at version {tick.version} committed at {self.version}: plan it again")
        self.running, self.waiting = tick.running, tick.waiting
        self._asked = {}
        if self.order is not None:
            self.order.committed(tick.held)
        return tick

    def _leave(self, running: list[LoopState], tick: Tick, waiting: deque[LoopState]) -> list[LoopState]:
        """`running` less the tick's failed and finished requests. Each leaving request's place goes to
        the next waiting one, asked for its step now, so its batch row changes hands once (and the
        place is used this tick); the places left over are filled by the last running requests. An
        arrival that fails or finishes at once leaves too, its place going on to the next."""
        gone = {id(state) for state in (*tick.finished, *(state for state, _ in tick.failed))}
        running = list(running)
        for i in range(len(running)):
            while id(running[i]) in gone and waiting:
                running[i] = arrival = waiting.popleft()
                asked = self._next(arrival)
                if isinstance(asked, Exception):
                    tick.failed.append((arrival, asked))
                    gone.add(id(arrival))
                elif isinstance(asked, Done):
                    tick.finished.append(arrival)
                    gone.add(id(arrival))
        return _without(running, [state for state in running if id(state) in gone])

    def _next(self, state: LoopState) -> WorkPlan | Done | Exception:
        known = self._asked.get(id(state))
        if known is not None:
            return known[1]
        try:
            asked = self.loop.next(state)
        except Exception as err:
            asked = err
        self._asked[id(state)] = (state, asked)
        return asked

    def continue_within_tick(self, states: list[LoopState]) -> list[Group]:
        """The next steps of requests whose last step continues in the same tick (StepKind.continues),
        grouped as a tick groups. A request whose loop is done waits for the next tick to finish."""
        members = [(state, plan) for state in states if not isinstance(plan := self.loop.next(state), Done)]
        return self._grouped(members)

    def _grouped(self, members: list[tuple[LoopState, WorkPlan]]) -> list[Group]:
        by_signature: dict[object, list] = {}
        for member in members:  # in row order
            same = by_signature.get(member[1].signature)
            if same is None:
                by_signature[member[1].signature] = [member]
            else:
                same.append(member)
        groups = []
        for same in by_signature.values():
            start = 0
            for lane, size in enumerate(self.buckets.chunks(len(same))):
                groups.append(Group(same[start : start + size], lane))
                start += size
        return groups


def _without(running: list[LoopState], gone: list[LoopState]) -> list[LoopState]:
    """`running` less `gone`, each hole filled by the last request (see Scheduler.remove)."""
    gone_ids = {id(state) for state in gone}
    running = list(running)
    i = 0
    while i < len(running):
        if id(running[i]) in gone_ids:
            last = running.pop()
            if i < len(running):
                running[i] = last  # checked again at i: it may be leaving too
        else:
            i += 1
    return running
