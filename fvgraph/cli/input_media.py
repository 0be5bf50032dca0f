"""The files `fvgraph generate` starts its requests from: `--image` (image-to-video and image-edit
cards) and `--video` (video-to-video on a Wan text-to-video card), read before any model loads so a
bad path costs nothing. The loop checks the rest (a card that takes no image or video, a frame count
its VAE cannot take), as it does for the Python API's Request(image=..., video=...)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import av
from PIL import Image, UnidentifiedImageError

from fvgraph.media_file import INPUT_IMAGE_FORMATS


def read_image(path: Optional[Path]) -> Optional[Image.Image]:
    """The image at `path` as RGB; ValueError naming --image when it is missing or not a PNG, JPEG or WebP."""
    if path is None:
        return None
    try:
        with Image.open(path, formats=INPUT_IMAGE_FORMATS) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as err:
        raise ValueError(f"--image {path}: not a readable PNG, JPEG or WebP image ({err})") from None


def read_video(path: Optional[Path]) -> Optional[list[Image.Image]]:
    """The video at `path` (any container and codec PyAV's FFmpeg decodes) as RGB frames; ValueError
    naming --video when it is missing, undecodable or holds no frame."""
    if path is None:
        return None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"--video {path}: holds no video stream")
            frames = [frame.to_image().convert("RGB") for frame in container.decode(container.streams.video[0])]
    except (OSError, av.error.FFmpegError) as err:
        raise ValueError(f"--video {path}: not a decodable video ({err})") from None
    if not frames:
        raise ValueError(f"--video {path}: holds no frames")
    return frames
