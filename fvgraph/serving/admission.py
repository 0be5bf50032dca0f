"""Admission: which accepted requests may enter the engine, by the memory they reserve.

    offer(request)   never fits the budget -> RequestRejected naming the limit (HTTP 400)
                     the queue is full     -> QueueFull with a Retry-After estimate (HTTP 429)
                     otherwise it waits in the queue, FIFO
    admit()          the waiting requests that fit now, in order; each reserves its estimate
    started(id)      it ran its first step: it no longer counts as queued
    release(id)      it ended (done, failed, cancelled): its reservation is freed

The queue depth counts every accepted request that has not started: those waiting for memory and
those admitted but still waiting for a place in the engine. Safe to call from any thread.

Retry-After is the queue's estimated wait: the requests queued ahead (the whole queue depth) times
the seconds per request the queue has measured, rounded up, at least 1 s and at most MAX_RETRY_AFTER_S.
Seconds per request is the mean time the last 32 requests spent from admission to their end,
divided by the requests admitted now (at least 1, at most max_running): at this concurrency, one of
them ends about that often. Before any request has ended, the longest time a request now in the engine
has spent there so far stands in for that mean (it is a lower bound).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from fvgraph.serving.memory_reservation import MemoryModel, Reservation
from fvgraph.request import Request, RequestRejected

MAX_RETRY_AFTER_S = 3600  # a wait estimate past an hour says more about the estimate than the queue


class QueueFull(Exception):
    """The queue holds `max_queue` requests; try again after `retry_after` seconds."""

    def __init__(self, max_queue: int, retry_after: int):
        self.retry_after = retry_after
        super().__init__(f"the queue is full ({max_queue} requests waiting, --max-queue); retry after {retry_after} s")


class Admission:
    def __init__(self, model: MemoryModel, budget_bytes: int, max_queue: int, max_running: int,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if budget_bytes <= 0:
            raise ValueError(f"memory budget={budget_bytes} bytes must be positive")
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be at least 1")
        self.model = model
        self.budget = budget_bytes
        self.max_queue = max_queue
        self.max_running = max_running
        self.clock = clock  # seconds, for the time each request spends admitted
        self._lock = threading.Lock()
        self._waiting: deque[tuple[Request, Reservation]] = deque()
        self._not_started: set[str] = set()
        self._reserved: dict[str, Reservation] = {}
        self._admitted_at: dict[str, float] = {}
        self._recent_seconds: deque[float] = deque(maxlen=32)

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(r.total for r in self._reserved.values())

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._not_started)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._reserved) - len(self._not_started)

    def offer(self, request: Request) -> Reservation:
        """Queue a resolved request, or raise (see the module docstring)."""
        reservation = self.model.estimate(request)
        if reservation.total > self.budget:
            parts = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in reservation.parts.items())
            tiling = "" if self.model.tiling is not None else " (or serve with vae_tiling, which decodes in tiles)"
            raise RequestRejected(
                "memory_budget",
                f"this request ({request.num_frames}x{request.height}x{request.width}) needs about "
                f"{reservation.total / 2**20:.1f} MiB ({parts}), more than the whole budget of {self.budget / 2**20:.1f} MiB "
                f"(--memory-budget); ask for fewer frames or a smaller size{tiling}",
            )
        with self._lock:
            if len(self._waiting) + len(self._not_started) >= self.max_queue:
                raise QueueFull(self.max_queue, self._retry_after())
            self._waiting.append((request, reservation))
        return reservation

    def admit(self) -> list[Request]:
        """Take the waiting requests that fit now, FIFO: one that does not fit holds back those behind it."""
        admitted = []
        with self._lock:
            free = self.budget - sum(r.total for r in self._reserved.values())
            while self._waiting and self._waiting[0][1].total <= free:
                request, reservation = self._waiting.popleft()
                free -= reservation.total
                self._reserved[request.request_id] = reservation
                self._not_started.add(request.request_id)
                self._admitted_at[request.request_id] = self.clock()
                admitted.append(request)
        return admitted

    def withdraw(self, request_id: str) -> bool:
        """Take a request that is still waiting for memory out of the queue. False if it is not waiting."""
        with self._lock:
            for item in self._waiting:
                if item[0].request_id == request_id:
                    self._waiting.remove(item)
                    return True
        return False

    def started(self, request_id: str) -> None:
        with self._lock:
            self._not_started.discard(request_id)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._not_started.discard(request_id)
            if self._reserved.pop(request_id, None) is not None:
                self._recent_seconds.append(self.clock() - self._admitted_at.pop(request_id))

    @property
    def retry_after(self) -> int:
        """The estimated wait, in whole seconds, of a request queued now (see the module docstring)."""
        with self._lock:
            return self._retry_after()

    def _retry_after(self) -> int:
        ahead = len(self._waiting) + len(self._not_started)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(ahead * self._seconds_per_request())))

    def _seconds_per_request(self) -> float:
        if self._recent_seconds:
            spent = sum(self._recent_seconds) / len(self._recent_seconds)
        else:  # nothing has ended yet: the longest time so far of those in the engine
            now = self.clock()
            spent = max((now - at for at in self._admitted_at.values()), default=0.0)
        return spent / max(1, min(self.max_running, len(self._reserved)))
