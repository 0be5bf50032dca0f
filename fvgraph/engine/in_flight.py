"""What an engine-wide change (new weights, sleep) does first with the requests in flight."""

from __future__ import annotations

from collections.abc import Callable


def settle_in_flight(ids: list[str], stop: bool, what: str, cancel: Callable[[str], None], has_work: Callable[[], bool],
                     tick: Callable[[str], None], drain: Callable[[], None]) -> None:  # fmt: skip
    """Run the requests `ids` to their end (`stop`: cancelled at their next step boundary first), then
    settle a batch running ahead. Their results wait in the engine's outbox for the next tick()."""
    if stop:
        for request_id in ids:
            cancel(request_id)
    while has_work():
        tick(what)
    drain()
