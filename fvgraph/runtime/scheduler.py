"""The scheduler: which requests run this tick, and which of their steps run together.

Each tick: admit waiting requests FIFO while there is room (running requests always keep their
place), drop cancelled ones at the step boundary, ask every running loop for its next WorkPlan, and
group the plans that can share one graph: same step kind and same shapes past the batch dim. A group
larger than the biggest batch bucket is split into lanes. Requests at different timesteps, with different
guidance scales, seeds and step counts fall into one group: those are [B] tensors, not shapes. A step
whose kind `continues` (the first launch of a step its loop splits in two) has its request's next
step grouped again in the same tick (`continue_within_tick`), once the engine ran it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.contract.loop import Loop, LoopState
from fvgraph.contract.plan import Done, WorkPlan


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


class Scheduler:
    def __init__(self, loop: Loop, buckets: BucketSpec, max_running: int):
        if max_running < 1:
            raise ValueError(f"max_running={max_running} must be at least 1")
        self.loop = loop
        self.buckets = buckets
        self.max_running = max_running
        self.waiting: deque[LoopState] = deque()
        self.running: list[LoopState] = []
        self.cancel_requested: set[str] = set()

    def submit(self, state: LoopState) -> None:
        self.waiting.append(state)

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step boundary; the other requests are not disturbed."""
        self.cancel_requested.add(request_id)

    def ended(self, request_id: str) -> None:
        """The request has its result: a cancel asked for it no longer applies (its id may come again)."""
        self.cancel_requested.discard(request_id)

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
        gone_ids = {id(state) for state in gone}
        i = 0
        while i < len(self.running):
            if id(self.running[i]) in gone_ids:
                last = self.running.pop()
                if i < len(self.running):
                    self.running[i] = last  # checked again at i: it may be leaving too
            else:
                i += 1

    def tick(self) -> Tick:
        tick = Tick()
        if self.cancel_requested:
            tick.cancelled = [s for s in self.waiting if s.request_id in self.cancel_requested]
            for state in tick.cancelled:
                self.waiting.remove(state)
            running_cancelled = [s for s in self.running if s.request_id in self.cancel_requested]
            self.remove(running_cancelled)
            tick.cancelled += running_cancelled
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        plans = []
        for state in self.running:
            try:
                plans.append(self.loop.next(state))
            except Exception as err:  # one request's loop cannot go on: it fails alone, the tick goes on
                tick.failed.append((state, err))
                plans.append(None)
        if tick.failed:
            kept = [(state, plan) for state, plan in zip(self.running, plans) if plan is not None]
            self.remove([state for state, _ in tick.failed])
            plan_of = {id(state): plan for state, plan in kept}
            plans = [plan_of[id(state)] for state in self.running]
        tick.finished = [state for state, plan in zip(self.running, plans) if isinstance(plan, Done)]
        if tick.finished:  # their rows are refilled by the last running requests
            plan_of = {id(state): plan for state, plan in zip(self.running, plans)}
            self.remove(tick.finished)
            plans = [plan_of[id(state)] for state in self.running]
        tick.groups = self._grouped(list(zip(self.running, plans)))
        return tick

    def continue_within_tick(self, states: list[LoopState]) -> list[Group]:
        """The next steps of requests whose last step continues in the same tick (StepKind.continues),
        grouped as a tick groups. A request whose loop is done waits for the next tick to finish."""
        members = [(state, plan) for state in states if not isinstance(plan := self.loop.next(state), Done)]
        return self._grouped(members)

    def _grouped(self, members: list[tuple[LoopState, WorkPlan]]) -> list[Group]:
        by_signature: dict[object, list] = {}
        for member in members:  # in row order
            by_signature.setdefault(member[1].signature, []).append(member)
        groups = []
        for same in by_signature.values():
            start = 0
            for lane, size in enumerate(self.buckets.chunks(len(same))):
                groups.append(Group(same[start : start + size], lane))
                start += size
        return groups
