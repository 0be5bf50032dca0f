"""Generated frames as the bytes a client downloads: an H.264 mp4 (PyAV), a JPEG thumbnail, a JPEG
spritesheet (every frame in a grid), a PNG image.

The mp4 is "faststart": its index (the moov box) comes before the frames (mdat), so a browser can
start playing, and seek, before the whole file has arrived. FFmpeg moves the index by reading the
finished file back by name, so the mp4 is written to a temporary file, not to memory.
"""

from __future__ import annotations

import io
import math
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from fvgraph.media_file import write_mp4


# The frame rates a served mp4 is written at: each is kept as given (to 1/1001 precision), so a
# video's length is frames / mp4_rate(fps). Below 1/1001 the rate would round to 0, which libx264
# silently replaces by 24.
MIN_FPS, MAX_FPS = 1.0, 120.0
SPRITE_MAX_SIDE = 256  # a spritesheet's tiles are the frames scaled down to at most this many pixels a side


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
    with tempfile.TemporaryDirectory(prefix="fvgraph-mp4-") as folder:
        path = Path(folder) / "video.mp4"
        write_mp4(frames, path, mp4_rate(fps))
        return path.read_bytes()


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


def sprite_grid(num_frames: int) -> tuple[int, int]:
    """(columns, rows) of a spritesheet of `num_frames`: ceil(sqrt(n)) columns, as many rows as needed."""
    columns = math.ceil(math.sqrt(num_frames))
    return columns, math.ceil(num_frames / columns)


def encode_spritesheet(frames: np.ndarray) -> bytes:
    """uint8 [T, H, W, 3] -> a JPEG of every frame in a grid (sprite_grid), left to right, top to
    bottom; each tile is its frame scaled down to at most SPRITE_MAX_SIDE a side (never up); the
    cells after the last frame are black."""
    _check(frames)
    count, height, width, _ = frames.shape
    scale = min(1.0, SPRITE_MAX_SIDE / max(height, width))
    tile_w, tile_h = max(1, round(width * scale)), max(1, round(height * scale))
    columns, rows = sprite_grid(count)
    sheet = Image.new("RGB", (columns * tile_w, rows * tile_h))
    for index, frame in enumerate(frames):
        tile = Image.fromarray(frame)
        if tile.size != (tile_w, tile_h):
            tile = tile.resize((tile_w, tile_h), Image.Resampling.LANCZOS)
        sheet.paste(tile, ((index % columns) * tile_w, (index // columns) * tile_h))
    buffer = io.BytesIO()
    sheet.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()
