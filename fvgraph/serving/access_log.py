"""The server's own log of what it served: one access line per request when it ends, and a throughput
line at most every `every_s` seconds while requests end, on the `fvgraph.access` logger.

    request 3f2a... tiny-wan 9x64x64 8/8 steps done 1.84 s
    throughput: 12 requests ended in the last 60.2 s (0.20/s): 11 done, 1 failed; 3 in flight

The shape is read from the result's frames, the steps from the request's step events: a listener on
the AsyncEngine's events, as the metrics are (fvgraph/serving/serving_metrics.py), with nothing kept
per request beyond the steps counted until it ends.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.serving.request_events import RequestEvent

ACCESS_LOGGER = "fvgraph.access"
THROUGHPUT_EVERY_S = 60.0


class AccessLog:
    def __init__(self, served: AsyncEngine, every_s: float = THROUGHPUT_EVERY_S, logger: str = ACCESS_LOGGER):
        self.served = served
        self.card_id = served.engine.card.card_id
        self.every_s = every_s
        self.log = logging.getLogger(logger)
        self._steps: dict[str, tuple[int, int | None]] = {}  # request id -> (steps done, of total)
        self._window: Counter[str] = Counter()  # statuses ended since the last throughput line
        self._window_began = time.monotonic()
        served.listeners.append(self.on_event)

    def on_event(self, event: RequestEvent) -> None:
        if event.kind == "step":
            self._steps[event.request_id] = (event.step or 0, event.total)
            return
        if not event.terminal:
            return
        done, total = self._steps.pop(event.request_id, (0, None))
        result = event.result
        frames = None if result is None else result.frames
        shape = "-" if frames is None else "x".join(str(n) for n in frames.shape[:3])
        seconds = None if result is None else result.timings.get("total")
        steps = f"{done}/{total}" if total else str(done)
        status = event.kind if event.reason is None else f"{event.kind} ({event.reason})"
        self.log.info("request %s %s %s %s steps %s %s", event.request_id, self.card_id, shape, steps, status,
                      "-" if seconds is None else f"{seconds:.2f} s")  # fmt: skip
        self._window[event.kind] += 1
        self._throughput()

    def _throughput(self) -> None:
        elapsed = time.monotonic() - self._window_began
        if elapsed < self.every_s:
            return
        ended = sum(self._window.values())
        statuses = ", ".join(f"{n} {kind}" for kind, n in sorted(self._window.items()))
        self.log.info("throughput: %d requests ended in the last %.1f s (%.2f/s): %s; %d in flight", ended, elapsed,
                      ended / elapsed, statuses, self.served.in_flight)  # fmt: skip
        self._window.clear()
        self._window_began = time.monotonic()
