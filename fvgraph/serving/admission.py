"""Admission: which accepted requests may enter the engine, by the memory they reserve.

    offer(request)   never fits the budget -> RequestRejected naming the limit (HTTP 400)
                     the queue is full     -> QueueFull with a Retry-After estimate (HTTP 429)
                     otherwise it waits in the queue, FIFO
    admit()          the waiting requests that fit now, in order; each reserves its estimate
    started(id)      it ran its first step: it no longer counts as queued
    release(id)      it ended (done, failed, cancelled): its reservation is freed

The queue depth counts every accepted request that has not started: those waiting for memory and
those admitted but still waiting for a place in the engine. Safe to call from any thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from fvgraph.serving.memory_reservation import MemoryModel, Reservation
from fvgraph.request import Request, RequestRejected


class QueueFull(Exception):
    """The queue holds `max_queue` requests; try again after `retry_after` seconds."""

    def __init__(self, max_queue: int, retry_after: int):
        self.retry_after = retry_after
        super().__init__(f"the queue is full ({max_queue} requests waiting, --max-queue); retry after {retry_after} s")


class Admission:
    def __init__(self, model: MemoryModel, budget_bytes: int, max_queue: int, max_running: int):
        if budget_bytes <= 0:
            raise ValueError(f"memory budget={budget_bytes} bytes must be positive")
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be at least 1")
        self.model = model
        self.budget = budget_bytes
        self.max_queue = max_queue
        self.max_running = max_running
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
            raise RequestRejected(
                "memory_budget",
                f"this request needs about {reservation.total / 2**20:.1f} MiB ({parts}), more than the whole "
                f"budget of {self.budget / 2**20:.1f} MiB (--memory-budget); ask for fewer frames or a smaller size",
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
                self._admitted_at[request.request_id] = time.monotonic()
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
                self._recent_seconds.append(time.monotonic() - self._admitted_at.pop(request_id))

    def _retry_after(self) -> int:
        """Seconds until about one place frees: the recent mean time in the engine, spread over the
        requests running at once (at least 1 s, at most 60 s)."""
        if not self._recent_seconds:
            return 1
        mean = sum(self._recent_seconds) / len(self._recent_seconds)
        running = max(1, min(self.max_running, len(self._reserved)))
        return max(1, min(60, math.ceil(mean * len(self._waiting) / running) or 1))
