"""The `image` of an image-to-video Request, and the `video` of a video-to-video one: each accepted
form in, RGB PIL images out.

Accepted: a path to an image file, a PIL image (any mode: converted to RGB, as diffusers'
load_image does), a uint8 array or tensor [H, W, 3] (tensors also [3, H, W]), or a float tensor in
[0, 1] (rounded to uint8, as an image file would hold it). Anything else is an error that names the
rule it breaks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import torch

MAX_SIDE = 8192  # a bigger image is a mistake, not a video frame
MAX_FRAMES = 1025  # a longer video is past every card's frame limit


def to_rgb_image(value: object) -> PIL.Image.Image:
    if isinstance(value, (str, Path)):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"image: {str(path)!r} is not a file")
        try:
            with PIL.Image.open(path) as opened:
                value = opened.convert("RGB")
        except PIL.UnidentifiedImageError:
            raise ValueError(f"image: {str(path)!r} is not an image file PIL can read") from None
    if isinstance(value, PIL.Image.Image):
        image = value if value.mode == "RGB" else value.convert("RGB")
    elif isinstance(value, (np.ndarray, torch.Tensor)):
        image = PIL.Image.fromarray(_pixels(value))
    else:
        raise ValueError(f"image must be a path, PIL image, uint8 array or tensor, got {type(value).__name__}")
    width, height = image.size
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise ValueError(f"image is {width}x{height}; each side must be within 1..{MAX_SIDE} pixels")
    return image


def _pixels(value: np.ndarray | torch.Tensor) -> np.ndarray:
    """[H, W, 3] uint8 from an array or tensor, checked."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dim() == 3 and value.shape[0] == 3 and value.shape[-1] != 3:
            value = value.permute(1, 2, 0)  # [3, H, W] -> [H, W, 3]
        if value.is_floating_point():
            if not torch.isfinite(value).all():
                raise ValueError("image contains NaN or Inf values")
            if value.min() < 0 or value.max() > 1:
                raise ValueError(f"image: a float tensor must hold values in [0, 1], got [{value.min():.3g}, {value.max():.3g}]")
            value = (value * 255).round().to(torch.uint8)
        value = value.numpy()
    if value.ndim != 3 or value.shape[-1] != 3:
        raise ValueError(f"image must have 3 channels, shape [H, W, 3] (or [3, H, W] as a tensor), got {list(value.shape)}")
    if value.dtype != np.uint8:
        raise ValueError(f"image: an array must be uint8 (0..255), got dtype {value.dtype}")
    return np.ascontiguousarray(value)


def to_rgb_frames(value: object) -> list[PIL.Image.Image]:
    """A video: a list (or tuple) of frames, each in a form `to_rgb_image` takes, or a uint8 array or
    tensor [T, H, W, 3]; every frame the same size. Errors name `video` and the frame."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        if value.ndim != 4:
            raise ValueError(f"video as an array must be [T, H, W, 3], got shape {list(value.shape)}")
        value = list(value)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"video must be a list of frames or a uint8 array [T, H, W, 3], got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_FRAMES:
        raise ValueError(f"video has {len(value)} frames; it must have 1..{MAX_FRAMES}")
    frames = []
    for index, frame in enumerate(value):
        try:
            frames.append(to_rgb_image(frame))
        except ValueError as error:
            raise ValueError(f"video frame {index}: {error}") from None
        if frames[-1].size != frames[0].size:
            raise ValueError(f"video frame {index} is {_size(frames[-1])}, frame 0 is {_size(frames[0])}: every frame must be one size")
    return frames


def _size(image: PIL.Image.Image) -> str:
    return "{}x{}".format(*image.size)
