"""A video uploaded as `input_reference` for a video-to-video request: checked, then decoded to frames.

Only the MP4 and WebM demuxers see the bytes (chosen by the file's signature, never by probing every
demuxer FFmpeg has), only the codecs in CODECS decode them, and the size is checked from the stream's
header before any frame is decoded: at most MAX_REFERENCE_PIXELS per frame and the card's frame limit.
A frame count the card's VAE cannot take (k * temporal_multiple + 1) is cut to the longest one it can,
and the cut is reported with the request's notes.
"""

from __future__ import annotations

import io

import av
from PIL import Image

from fvgraph.request import RequestRejected

# File signatures: an MP4 (ISO BMFF) box type at byte 4, and the EBML magic that starts a WebM.
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide")
_EBML = b"\x1a\x45\xdf\xa3"
CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})


def is_video_upload(data: bytes) -> bool:
    """Whether the bytes start as an MP4 or a WebM (what `decode_video_upload` opens)."""
    return data[4:8] in _MP4_BOXES or data[:4] == _EBML


def decode_video_upload(data: bytes, max_frames: int, max_pixels: int, temporal_multiple: int) -> tuple[list[Image.Image], str | None]:
    """The upload's frames as RGB images, at most `max_frames`, cut to k * temporal_multiple + 1;
    and a note when frames were cut (None otherwise). RequestRejected naming input_reference."""
    container_format = "webm" if data[:4] == _EBML else "mp4"
    try:
        with av.open(io.BytesIO(data), format=container_format) as container:
            if not container.streams.video:
                raise RequestRejected("input_reference", f"the {container_format} upload holds no video stream")
            stream = container.streams.video[0]
            codec, width, height = stream.codec_context.name, stream.codec_context.width, stream.codec_context.height
            if codec not in CODECS:
                raise RequestRejected("input_reference", f"video codec {codec!r} is not one this server decodes "
                                                         f"({', '.join(sorted(CODECS))})")  # fmt: skip
            if width * height > max_pixels:
                raise RequestRejected("input_reference", f"{width}x{height} frames have more than {max_pixels} pixels")
            frames = []
            for frame in container.decode(stream):
                if len(frames) == max_frames:
                    raise RequestRejected("input_reference", f"the video has more than {max_frames} frames, "
                                                             "this card's limit")  # fmt: skip
                frames.append(frame.to_image().convert("RGB"))
    except av.error.FFmpegError as err:
        raise RequestRejected("input_reference", f"is not a decodable {container_format} video: {err}") from None
    if not frames:
        raise RequestRejected("input_reference", "the video has no frames")
    kept = (len(frames) - 1) // temporal_multiple * temporal_multiple + 1
    note = None
    if kept != len(frames):
        note = f"the video's {len(frames)} frames were cut to its first {kept}: the card takes k * {temporal_multiple} + 1"
    return frames[:kept], note
