"""What the event loop tells AsyncEngine's engine thread (fvgraph/serving/async_engine.py): one frozen
dataclass per command, put on the thread's queue and dispatched there by type.

A command that answers carries the future it answers on; the thread sets it only if the caller is
still waiting (`set_running_or_notify_cancel`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.serving.request_events import CancelReason


@dataclass(frozen=True)
class Accepted:
    """A request accepted on the event loop, before admission may hand it to the thread: when it was
    accepted (perf_counter) and its deadline (monotonic; None: none)."""

    request_id: str
    deadline: float | None
    accepted_at: float


@dataclass(frozen=True)
class Refused:
    """Admission refused a request just announced as Accepted: forget its deadline and start time."""

    request_id: str


@dataclass(frozen=True)
class Cancel:
    """Cancel a request; `answer` gets whether it was in flight."""

    request_id: str
    reason: CancelReason
    answer: concurrent.futures.Future


@dataclass(frozen=True)
class Warmup:
    """Engine.warmup on these requests; `done` gets its results or its exception."""

    requests: tuple[Request, ...]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Call:
    """`fn(engine)` between two ticks; `done` gets its result or its exception."""

    fn: Callable[[Engine], Any]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Sleep:
    """Engine.sleep(level) once nothing is in flight (AsyncEngine.sleep waited); `done` gets its answer."""

    level: int
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Wake:
    """Engine.wake(); `done` gets its answer or its exception."""

    done: concurrent.futures.Future


@dataclass(frozen=True)
class Stop:
    """End the thread once the engine has no work left."""


EngineCommand = Accepted | Refused | Cancel | Warmup | Call | Sleep | Wake | Stop
