"""Each video's fragmented MP4 while it decodes, for `GET /v1/videos/{id}/content?stream=true`.

The server's AsyncEngine hands every video's frames here as they decode (a frame listener); each
video in flight gets a `LiveVideo`: an Fmp4Encoder (fvgraph/serving/fmp4_stream.py) run on a worker
thread, one batch of frames after another, and the init segment and fragments made so far. A reader
gets them from the start (one that comes late misses nothing), then each new fragment as it is made,
until media.complete; a video that fails or is cancelled ends its readers' streams where they are.
A reader that goes away (a client that hung up) is only dropped from its video's readers: the
encoding, the other readers and the request go on. A live video is forgotten once the server has
stored its file (then `?stream=true` serves the file) or once it failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fvgraph.events import DecodedFrames, MediaChunk, MediaComplete, MediaInit
from fvgraph.serving.fmp4_stream import Fmp4Encoder
from fvgraph.serving.request_events import RequestEvent

log = logging.getLogger(__name__)


class LiveVideo:
    """One video's stream so far: its init segment and fragments, and whether it ended."""

    def __init__(self, video_id: str, fps: float):
        self.video_id = video_id
        self.encoder = Fmp4Encoder(video_id, fps)
        self.parts: list[bytes] = []  # the init segment, then each fragment in order
        self.complete = False  # media.complete: every frame is in `parts`
        self.ended = False  # no more parts will come (complete, failed or cancelled)
        self.readers = 0
        self._changed = asyncio.Event()
        self._frames: asyncio.Queue[DecodedFrames | None] = asyncio.Queue()
        self._encoding = asyncio.ensure_future(self._encode())

    def add(self, frames: DecodedFrames) -> None:
        self._frames.put_nowait(frames)

    def end(self) -> None:
        """No more frames will come (the request failed or was cancelled): its readers stop."""
        self._frames.put_nowait(None)

    async def _encode(self) -> None:
        try:
            while (frames := await self._frames.get()) is not None:
                events = await asyncio.to_thread(self.encoder.add, frames)
                if frames.last:
                    events += await asyncio.to_thread(self.encoder.finish)
                self._publish(events)
                if self.complete:
                    return
        except Exception:  # an encoding error ends this video's stream only
            log.exception("video %s: streaming its mp4 failed", self.video_id)
        finally:
            self.encoder.abort()
            self.ended = True
            self._wake()

    def _publish(self, events: list[MediaInit | MediaChunk | MediaComplete]) -> None:
        for event in events:
            if isinstance(event, MediaComplete):
                self.complete = True
            else:
                self.parts.append(event.data)
        if events:
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self) -> AsyncIterator[bytes]:
        """The stream's bytes from its start: what is there, then each part as it comes, to its end."""
        self.readers += 1
        try:
            sent = 0
            while True:
                changed = self._changed
                while sent < len(self.parts):
                    yield self.parts[sent]
                    sent += 1
                if self.ended:
                    return
                await changed.wait()
        finally:  # the end, or a reader that went away: only this reader is dropped
            self.readers -= 1


class VideoStreams:
    """The live videos by id; fed by the AsyncEngine's frame listener and request events."""

    def __init__(self):
        self.live: dict[str, LiveVideo] = {}

    def open(self, video_id: str, fps: float) -> LiveVideo:
        """The video's stream, started empty when its frames have not begun to come."""
        live = self.live.get(video_id)
        if live is None:
            live = self.live[video_id] = LiveVideo(video_id, fps)
        return live

    def frames(self, frames: DecodedFrames, fps: float | None) -> None:
        """A video's next frames (`fps` None: not a video this server streams)."""
        if fps is not None:
            self.open(frames.request_id, fps).add(frames)

    def track(self, event: RequestEvent) -> None:
        """A request that failed or was cancelled: its stream ends and is forgotten."""
        if event.kind in ("failed", "cancelled"):
            self.drop(event.request_id)

    def drop(self, video_id: str) -> None:
        """Forget a video's stream (its readers finish what they have, then stop)."""
        live = self.live.pop(video_id, None)
        if live is not None and not live.ended:
            live.end()
