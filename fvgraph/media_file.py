"""Writing generated frames to a file a person can open: .gif (Pillow) or .mp4 (PyAV: H.264 when its
FFmpeg has it, MPEG-4 part 2 otherwise; faststart: the index before the frames, so it plays while it
downloads; the server's mp4s, fvgraph/serving/media_encode.py, are written by the same `write_mp4`),
or, for a one-frame result (an image card's), .png, .jpg or .webp (Pillow). `Result.save(path)`, the
CLI and the JSON-lines server write through it.

`check_video_output` checks a path's suffix, the frame rate and, for .mp4, that an encoder is there,
so a command can refuse bad output options before it does any work.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

VIDEO_SUFFIXES = (".gif", ".mp4")
FASTSTART = {"movflags": "+faststart"}  # the mp4 muxer's option: moov before mdat
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
# The image formats a request may start from (the HTTP API's uploads, `generate --image`), opened by
# these PIL plugins only: an input never reaches Ghostscript, TIFF or any other decoder.
INPUT_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
# libx264's settings for every mp4 fvgraph writes, stored or streamed (fvgraph/serving/fmp4_stream.py),
# so the two hold the same bitstream. mbtree off: with it, on a CPU with AVX-512, libx264 encoded the
# same 32x32 frames to different bitstreams from call to call in one process (one frame's decisions
# differed); without it, one input is one bitstream again (tests/test_http_*.py compare served
# videos bit for bit).
X264_OPTIONS = {"crf": "18", "preset": "veryfast", "x264-params": "mbtree=0"}


def check_video_output(path: str | Path, fps: int) -> None:
    """Raise ValueError, naming the option and the rule, when `path` and `fps` cannot be written."""
    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise ValueError(f"fps={fps!r} must be a whole number of frames per second, at least 1")
    suffix = Path(path).suffix.lower()
    if suffix not in VIDEO_SUFFIXES + IMAGE_SUFFIXES:
        raise ValueError(f"output path {path} must end in .gif or .mp4 (or, for an image, .png, .jpg or .webp)")
    if suffix == ".mp4":
        _mp4_codec()


def _mp4_codec() -> str:
    """The encoder .mp4 files are written with; ValueError when PyAV or every encoder is missing."""
    try:
        import av
    except ImportError as err:
        raise ValueError(f"writing .mp4 needs PyAV (the `av` package, a dependency of fvgraph): {err}; "
                         "install it or write .gif") from None  # fmt: skip
    for codec in ("libx264", "mpeg4"):
        try:
            av.codec.Codec(codec, "w")
            return codec
        except Exception:  # this FFmpeg build lacks it
            continue
    raise ValueError("writing .mp4 needs an H.264 or MPEG-4 encoder, and PyAV's FFmpeg has neither; write .gif")


def write_video(frames: np.ndarray, path: str | Path, fps: int = 8) -> Path:
    """uint8 [T, H, W, 3] -> `path` (.gif or .mp4; T = 1 also .png, .jpg or .webp)."""
    path = Path(path)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    check_video_output(path, fps)
    if path.suffix.lower() in IMAGE_SUFFIXES and frames.shape[0] != 1:
        raise ValueError(f"{path.name}: an image file holds one frame and this result has {frames.shape[0]}; write .gif or .mp4")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in IMAGE_SUFFIXES:
        Image.fromarray(frames[0]).save(path)
    elif path.suffix.lower() == ".gif":
        # Imported where a GIF is written: `import diffusers` loads dynamo and inductor, which
        # `import fvgraph` (this module comes with Request) should not pay for.
        from diffusers.utils import export_to_gif

        export_to_gif([Image.fromarray(frame) for frame in frames], str(path), fps=fps)
    else:
        write_mp4(frames, path, fps, _mp4_codec())
    return path


def write_mp4(frames: np.ndarray, path: Path, rate: Fraction | int, codec: str = "libx264") -> None:
    """uint8 [T, H, W, 3] -> a faststart mp4 at `path`, `rate` frames per second: what the server sends
    and what the CLI and the JSON-lines server write (they fall back to MPEG-4 part 2 where PyAV's
    FFmpeg has no H.264)."""
    import av  # PyAV: imported where an .mp4 is written

    _, height, width, _ = frames.shape
    if height % 2 or width % 2:  # yuv420p stores chroma at half resolution
        raise ValueError(f"an mp4 (yuv420p) needs an even height and width, got {height}x{width}")
    with av.open(str(path), mode="w", format="mp4", options=FASTSTART) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = dict(X264_OPTIONS)
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
