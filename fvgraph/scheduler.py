"""The scheduler: which requests run this tick, and which of their steps run together.

Each tick: admit waiting requests FIFO while there is room (running requests always keep their
place), drop cancelled ones at the step boundary, ask every running loop for its next WorkPlan, and
group the plans that can share one graph: same step kind and same shapes past the batch dim. A group
larger than the biggest batch bucket is split. Requests at different timesteps, with different
guidance scales, seeds and step counts fall into one group: those are [B] tensors, not shapes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from fvgraph.buckets import BucketSpec
from fvgraph.loop import Done, WorkPlan
from fvgraph.t2v_loop import T2VState, TextToVideoLoop


@dataclass
class Tick:
    finished: list[T2VState] = field(default_factory=list)
    cancelled: list[T2VState] = field(default_factory=list)
    groups: list[list[tuple[T2VState, WorkPlan]]] = field(default_factory=list)


class Scheduler:
    def __init__(self, loop: TextToVideoLoop, buckets: BucketSpec, max_running: int):
        if max_running < 1:
            raise ValueError(f"max_running={max_running} must be at least 1")
        self.loop = loop
        self.buckets = buckets
        self.max_running = max_running
        self.waiting: deque[T2VState] = deque()
        self.running: list[T2VState] = []
        self.cancel_requested: set[str] = set()

    def submit(self, state: T2VState) -> None:
        self.waiting.append(state)

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step boundary; the other requests are not disturbed."""
        self.cancel_requested.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def tick(self) -> Tick:
        tick = Tick()
        for queue in (self.waiting, self.running):
            for state in [s for s in queue if s.request_id in self.cancel_requested]:
                queue.remove(state)
                tick.cancelled.append(state)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        groups: OrderedDict[object, list] = OrderedDict()
        still_running = []
        for state in self.running:
            plan = self.loop.next(state)
            if isinstance(plan, Done):
                tick.finished.append(state)
                continue
            still_running.append(state)
            groups.setdefault(plan.signature, []).append((state, plan))
        self.running = still_running
        for members in groups.values():
            start = 0
            for size in self.buckets.chunks(len(members)):
                tick.groups.append(members[start : start + size])
                start += size
        return tick
