"""What a request reports while it is served: queued, started, each denoise step, and how it ended.

The AsyncEngine turns the engine's per-step callbacks and tick results into these events; the HTTP
front end forwards them as Server-Sent Events and keeps each video's status from them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Literal

from fvgraph.request import Result

EventKind = Literal["queued", "started", "wait", "step", "preview", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})
# Why a request was cancelled: a client asked, its deadline passed, or the server shut down.
CancelReason = Literal["client", "timeout", "shutdown", "sleep"]


@dataclass(frozen=True)
class RequestEvent:
    """One thing that happened to one request.

    `preview` events (Request.preview_every, docs/previews.md) carry the step (1-based) of `total` and
    the request's preview image as PNG bytes (`image_png`; base64 on the wire). `step` events carry the denoise step just done (`step`, 1-based) of `total`, the step kind, how
    long the batch it ran in took (`step_seconds`) and how many requests shared it (`batch`). `wait`
    events name a long wait the engine is in while the request is in it (`activity`: "compiling
    denoise_cfg, batch bucket 1"), once as it begins and once as it ends (`wait_seconds`). Terminal
    events (done / failed / cancelled) carry the Result; a cancelled one says why in `reason`.
    """

    request_id: str
    kind: EventKind
    step: int | None = None
    total: int | None = None
    step_kind: str | None = None
    step_seconds: float | None = None
    batch: int | None = None
    error: str | None = None
    reason: CancelReason | None = None
    activity: str | None = None
    wait_seconds: float | None = None
    image_png: bytes | None = field(default=None, repr=False, compare=False)  # a preview's image, PNG
    result: Result | None = field(default=None, repr=False, compare=False)

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL

    def to_json(self) -> dict:
        """The event as sent on the wire (no tensors or frames)."""
        body = {"request_id": self.request_id, "event": self.kind}
        for name in ("step", "total", "step_kind", "step_seconds", "batch", "error", "reason", "activity", "wait_seconds"):
            value = getattr(self, name)
            if value is not None:
                body[name] = round(value, 6) if isinstance(value, float) else value
        if self.total:
            body["progress"] = round(100 * (self.step or 0) / self.total, 2)
        if self.image_png is not None:  # a `preview` event: its image inline, base64 of the PNG's bytes
            body["image"] = {"mime": "image/png", "base64": base64.b64encode(self.image_png).decode("ascii")}
        if self.result is not None:
            body["timings"] = {k: round(v, 6) for k, v in self.result.timings.items()}
        return body
