"""Generated frames as the bytes a client downloads: an H.264 mp4 (PyAV), a JPEG thumbnail, a PNG image."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
from PIL import Image


# The frame rates a served mp4 is written at: each is kept as given (to 1/1001 precision), so a
# video's length is frames / mp4_rate(fps). Below 1/1001 the rate would round to 0, which libx264
# silently replaces by 24.
MIN_FPS, MAX_FPS = 1.0, 120.0


def mp4_rate(fps: float) -> Fraction:
    """The frame rate the mp4 of a video at `fps` is written at (MIN_FPS <= fps <= MAX_FPS)."""
    if not MIN_FPS <= fps <= MAX_FPS:
        raise ValueError(f"fps={fps} must be between {MIN_FPS:g} and {MAX_FPS:g}")
    return Fraction(fps).limit_denominator(1001)


def _check(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must be uint8 [T>=1, H, W, 3], got {frames.dtype} {list(frames.shape)}")


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """uint8 [T, H, W, 3] -> H.264 (yuv420p, so H and W must be even) in an mp4, one frame per input frame."""
    _check(frames)
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 in yuv420p needs an even size, got {width}x{height}")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=mp4_rate(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
    return buffer.getvalue()


def decode_mp4(data: bytes) -> np.ndarray:
    """The inverse, for checks: uint8 [T, H, W, 3]."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


IMAGE_MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(frame: np.ndarray, image_format: str, quality: int | None = None) -> bytes:
    """uint8 [H, W, 3] -> 'png', 'jpeg' or 'webp' bytes; `quality` (0-100, default 90) for jpeg and webp."""
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[-1] != 3:
        raise ValueError(f"a frame must be uint8 [H, W, 3], got {frame.dtype} {list(frame.shape)}")
    if image_format not in IMAGE_MEDIA_TYPES:
        raise ValueError(f"image_format={image_format!r} must be one of {', '.join(IMAGE_MEDIA_TYPES)}")
    lossy = {} if image_format == "png" else {"quality": 90 if quality is None else quality}
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format=image_format.upper(), **lossy)
    return buffer.getvalue()
