"""What a request emits while it runs, as typed events: request.*, step.*, media.*.

Each event is a frozen dataclass checked when it is built, so an invalid one cannot exist: a preview
of step 0 or of a step past the last, an image that is not uint8 [h, w, 3], a media chunk with no
stream or a negative time range, media of a preview stream marked final, decoded frames that are not
uint8 [t, H, W, 3] or run past the video's end. `event_type` is the
dotted name a client sees (`step.preview`, `media.chunk`, ...).

    engine.generate([Request(..., preview_every=2)], on_preview=lambda e: show(e.image))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

Fidelity = Literal["preview", "final"]  # a stream of previews, or the result itself
_FIDELITIES = ("preview", "final")


def _need(ok: bool, event: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{event}: {rule}")


def _check_id(event: str, request_id: str) -> None:
    _need(isinstance(request_id, str) and bool(request_id), event, f"request_id must be a non-empty string, got {request_id!r}")


def _check_step(event: str, step: int, total: int) -> None:
    _need(isinstance(total, int) and total >= 1, event, f"total must be an int >= 1, got {total!r}")
    _need(isinstance(step, int) and 1 <= step <= total, event, f"step must be an int in 1..total={total} (1-based), got {step!r}")


@dataclass(frozen=True)
class RequestEvent:
    """request.{queued,started,done,failed,cancelled}: one change of a request's life."""

    event_type: ClassVar[str] = "request"
    request_id: str
    status: Literal["queued", "started", "done", "failed", "cancelled"]
    error: str | None = None

    def __post_init__(self) -> None:
        _check_id("request event", self.request_id)
        statuses = ("queued", "started", "done", "failed", "cancelled")
        _need(self.status in statuses, "request event", f"status must be one of {statuses}, got {self.status!r}")
        _need((self.error is not None) == (self.status == "failed"), "request event",
              f"an error goes with status 'failed' and only with it (status {self.status!r}, error {self.error!r})")  # fmt: skip


@dataclass(frozen=True)
class StepEvent:
    """step.done: denoise step `step` (1-based) of `total` ran for the request."""

    event_type: ClassVar[str] = "step.done"
    request_id: str
    step: int
    total: int

    def __post_init__(self) -> None:
        _check_id("step event", self.request_id)
        _check_step("step event", self.step, self.total)


@dataclass(frozen=True)
class PreviewEvent:
    """step.preview: the request's denoised estimate after step `step` (1-based) drawn by the card's
    latent-to-RGB map at latent resolution; `image` uint8 [h, w, 3] (a video's middle frame). `total`
    is the request's step count: the preview with step == total is the last, of the final latents."""

    event_type: ClassVar[str] = "step.preview"
    request_id: str
    step: int
    image: np.ndarray = field(repr=False, compare=False)
    total: int = 0  # 0: not given (then step is only checked >= 1)

    def __post_init__(self) -> None:
        _check_id("preview", self.request_id)
        if self.total:
            _check_step("preview", self.step, self.total)
        else:
            _need(isinstance(self.step, int) and self.step >= 1, "preview", f"step must be an int >= 1 (1-based), got {self.step!r}")
        image = self.image
        _need(isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
              and image.shape[0] > 0 and image.shape[1] > 0, "preview",
              f"image must be a uint8 numpy array [h, w, 3], got {_describe(image)}")  # fmt: skip

    @property
    def last(self) -> bool:
        """Whether this is the preview of the last step (the final latents)."""
        return bool(self.total) and self.step == self.total


@dataclass(frozen=True)
class DecodedFrames:
    """media.frames: frames `start` .. `start + len(frames) - 1` (0-based) of the request's video, final,
    as the decode made them (fvgraph/loops/causal_decode.py); `frames` uint8 [t, H, W, 3]; `total` the
    frames the video will have. They come in order, with no gap: the one with `last` ends the video."""

    event_type: ClassVar[str] = "media.frames"
    request_id: str
    start: int
    frames: np.ndarray = field(repr=False, compare=False)
    total: int

    def __post_init__(self) -> None:
        _check_id("decoded frames", self.request_id)
        frames = self.frames
        _need(isinstance(frames, np.ndarray) and frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[-1] == 3
              and frames.shape[0] >= 1, "decoded frames", f"frames must be uint8 [t>=1, H, W, 3], got {_describe(frames)}")  # fmt: skip
        _need(isinstance(self.start, int) and self.start >= 0, "decoded frames", f"start must be an int >= 0, got {self.start!r}")
        _need(isinstance(self.total, int) and self.total >= self.start + len(frames), "decoded frames",
              f"total must be an int >= start + len(frames) = {self.start + len(frames)}, got {self.total!r}")  # fmt: skip

    @property
    def last(self) -> bool:
        """Whether these frames end the video."""
        return self.start + len(self.frames) == self.total


@dataclass(frozen=True)
class MediaStream:
    """One stream of a request's media: its name ("video", "preview"), its type, and whether it
    carries previews or the final result."""

    name: str
    mime: str
    fidelity: Fidelity = "final"

    def __post_init__(self) -> None:
        _need(isinstance(self.name, str) and bool(self.name), "media stream", f"name must be a non-empty string, got {self.name!r}")
        _need(isinstance(self.mime, str) and "/" in self.mime, "media stream", f"mime must be a type/subtype, got {self.mime!r}")
        _need(self.fidelity in _FIDELITIES, "media stream", f"fidelity must be one of {_FIDELITIES}, got {self.fidelity!r}")


@dataclass(frozen=True)
class MediaInit:
    """media.init: `stream` starts (an fMP4's init segment in `data`, where it has one)."""

    event_type: ClassVar[str] = "media.init"
    request_id: str
    stream: MediaStream
    data: bytes = b""

    def __post_init__(self) -> None:
        _check_media("media.init", self.request_id, self.stream)


@dataclass(frozen=True)
class MediaChunk:
    """media.chunk: bytes `data` of `stream`, chunk `index` (0-based), covering media time
    [start_s, end_s) seconds; `fidelity` says preview or final and must be its stream's."""

    event_type: ClassVar[str] = "media.chunk"
    request_id: str
    stream: MediaStream
    index: int
    start_s: float
    end_s: float
    data: bytes = field(repr=False)
    fidelity: Fidelity = "final"

    def __post_init__(self) -> None:
        _check_media("media.chunk", self.request_id, self.stream, self.fidelity)
        _need(isinstance(self.index, int) and self.index >= 0, "media.chunk", f"index must be an int >= 0, got {self.index!r}")
        _need(0 <= self.start_s <= self.end_s, "media.chunk",
              f"the time range must have 0 <= start_s <= end_s, got [{self.start_s}, {self.end_s})")  # fmt: skip
        _need(isinstance(self.data, bytes) and len(self.data) > 0, "media.chunk", "data must be non-empty bytes")


@dataclass(frozen=True)
class MediaComplete:
    """media.complete: `stream` ended after `chunks` chunks, at `fidelity` (its stream's)."""

    event_type: ClassVar[str] = "media.complete"
    request_id: str
    stream: MediaStream
    chunks: int
    fidelity: Fidelity = "final"

    def __post_init__(self) -> None:
        _check_media("media.complete", self.request_id, self.stream, self.fidelity)
        _need(isinstance(self.chunks, int) and self.chunks >= 0, "media.complete", f"chunks must be an int >= 0, got {self.chunks!r}")


def _check_media(event: str, request_id: str, stream: MediaStream, fidelity: str | None = None) -> None:
    _check_id(event, request_id)
    _need(isinstance(stream, MediaStream), event, f"media belongs to a stream: stream must be a MediaStream, got {stream!r}")
    if fidelity is not None:
        _need(fidelity in _FIDELITIES, event, f"fidelity must be one of {_FIDELITIES}, got {fidelity!r}")
        _need(fidelity == stream.fidelity, event, f"stream {stream.name!r} carries {stream.fidelity} media: "
                                                  f"its media cannot be marked {fidelity}")  # fmt: skip


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__
