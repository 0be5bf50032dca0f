"""A video's frames, as they decode, encoded into fragmented MP4: typed media.init / media.chunk /
media.complete events (fvgraph/events.py).

The encoder is the stored file's (libx264 with media_file.X264_OPTIONS, yuv420p, the same frame
rate), fed the same frames in the same order, so the stream holds the same H.264 bitstream as the
faststart file the server stores afterwards; only the container differs. The muxer writes an empty
`moov` first (`empty_moov`: the init segment, sent as media.init) and then one `moof` + `mdat`
fragment per encoded frame (`frag_every_frame`; `default_base_moof` so each fragment stands alone,
as browsers' Media Source Extensions want), flushed as each is written. `delay_moov` holds the init
segment back until the first fragment, so it carries the edit list that puts the first frame at time
0, as the stored file's does (libx264's B-frames give the first packet a decode time of -2 / fps;
without the edit list the stream's frames would start at 2 / fps, a gap a player waits at).
Fragments go out as media.chunk events, whole boxes only, each with the media time range its frames
cover. libx264 holds frames back
before its first packet (its lookahead and B-frames; 4 to 12 in the videos tried), so the first chunk
comes that many frames after the first frames arrive.

    encoder = Fmp4Encoder(request_id, fps=16)
    for frames in decoded:                      # fvgraph.events.DecodedFrames, in order
        events += encoder.add(frames)           # MediaInit once, then MediaChunk ...
    events += encoder.finish()                  # the last chunks, then MediaComplete
"""

from __future__ import annotations

import av
import numpy as np

from fvgraph.events import DecodedFrames, MediaChunk, MediaComplete, MediaInit, MediaStream
from fvgraph.media_file import X264_OPTIONS
from fvgraph.serving.media_encode import mp4_rate

FMP4_MOVFLAGS = "frag_every_frame+empty_moov+default_base_moof+delay_moov"
VIDEO_STREAM = MediaStream("video", "video/mp4")
_INIT_BOXES = (b"ftyp", b"moov")


class _Sink:
    """Where the muxer writes: bytes appended as they come."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data) -> int:
        self.data += data
        return len(data)


class Fmp4Encoder:
    """One video's fragmented MP4, built as its frames arrive."""

    def __init__(self, request_id: str, fps: float):
        self.request_id, self.rate = request_id, mp4_rate(fps)
        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format="mp4", options={"movflags": FMP4_MOVFLAGS, "flush_packets": "1"})
        self._stream = None
        self._next_frame = 0  # the frame the next DecodedFrames must start at
        self._sent_init = False
        self._chunks = 0
        self._samples = 0  # frames in the chunks sent so far
        self.finished = False

    def add(self, frames: DecodedFrames) -> list[MediaInit | MediaChunk]:
        """Encode `frames` (the next ones, in order); the init segment and the fragments now complete."""
        if frames.request_id != self.request_id or frames.start != self._next_frame:
            raise ValueError(f"frames of {frames.request_id!r} from {frames.start} do not continue {self.request_id!r} "
                             f"at frame {self._next_frame}")  # fmt: skip
        if self.finished:
            raise ValueError(f"{self.request_id!r}: the stream is finished")
        stream = self._stream or self._open(frames.frames.shape[1], frames.frames.shape[2])
        for frame in frames.frames:
            picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            self._container.mux(stream.encode(picture))
        self._next_frame += len(frames.frames)
        return self._take()

    def finish(self) -> list[MediaInit | MediaChunk | MediaComplete]:
        """Flush the encoder and close the file: the last fragments, then media.complete."""
        if self._stream is not None:
            self._container.mux(self._stream.encode())
        self._container.close()
        self.finished = True
        events = self._take(final=True)
        return [*events, MediaComplete(self.request_id, VIDEO_STREAM, self._chunks)]

    def abort(self) -> None:
        """Stop without finishing (the request failed or was cancelled)."""
        if not self.finished:
            self.finished = True
            try:
                self._container.close()
            except Exception:  # nothing was encoded yet: nothing to close
                pass

    def _open(self, height: int, width: int):
        if height % 2 or width % 2:
            raise ValueError(f"an mp4 (yuv420p) needs an even height and width, got {height}x{width}")
        stream = self._container.add_stream("libx264", rate=self.rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(X264_OPTIONS)
        self._stream = stream
        return stream

    def _take(self, final: bool = False) -> list[MediaInit | MediaChunk]:
        """The whole boxes written so far, as events: the init segment (ftyp + moov), then fragments."""
        boxes, used = _whole_boxes(self._sink.data)
        events: list = []
        if not self._sent_init:
            init = [b for b in boxes if b[4:8] in _INIT_BOXES]
            if len(init) < len(_INIT_BOXES):
                return events  # the header is not out yet
            events.append(MediaInit(self.request_id, VIDEO_STREAM, b"".join(init)))
            boxes, self._sent_init = boxes[len(init):], True
        # A fragment is its moof and the mdat after it; anything the muxer ends the file with (mfra) joins the last chunk.
        fragment: list[bytes] = []
        for box in boxes:
            if box[4:8] == b"moof" and fragment:
                events.append(self._chunk(fragment))
                fragment = []
            fragment.append(box)
        if fragment and (final or fragment[-1][4:8] == b"mdat"):
            events.append(self._chunk(fragment))
            fragment = []
        kept = sum(len(b) for b in fragment)
        del self._sink.data[: used - kept]
        return events

    def _chunk(self, boxes: list[bytes]) -> MediaChunk:
        samples = sum(_sample_count(box) for box in boxes if box[4:8] == b"moof")
        start = self._samples
        self._samples += samples
        event = MediaChunk(self.request_id, VIDEO_STREAM, self._chunks, float(start / self.rate),
                           float(self._samples / self.rate), b"".join(boxes))  # fmt: skip
        self._chunks += 1
        return event


def _whole_boxes(data: bytearray) -> tuple[list[bytes], int]:
    """The complete top-level MP4 boxes at the start of `data`, and how many bytes they take."""
    boxes, at = [], 0
    while at + 8 <= len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        if size < 8 or at + size > len(data):  # (64-bit sizes never occur for a fragment this small)
            break
        boxes.append(bytes(data[at : at + size]))
        at += size
    return boxes, at


def _sample_count(moof: bytes) -> int:
    """Frames in a moof: the sample_count of each trun in its trafs."""
    count = 0
    for traf in _children(moof[8:], b"traf"):
        for trun in _children(traf[8:], b"trun"):
            count += int.from_bytes(trun[12:16], "big")  # after size, type, version + flags
    return count


def _children(data: bytes, kind: bytes) -> list[bytes]:
    boxes, _ = _whole_boxes(bytearray(data))
    return [box for box in boxes if box[4:8] == kind]
