"""Writing generated frames to a file a person can open."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from diffusers.utils import export_to_gif, export_to_video
from PIL import Image


def write_video(frames: np.ndarray, path: str | Path, fps: int = 8) -> Path:
    """uint8 [T, H, W, 3] -> .gif (always available) or .mp4 (needs imageio with ffmpeg)."""
    path = Path(path)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".gif":
        export_to_gif([Image.fromarray(frame) for frame in frames], str(path), fps=fps)
    elif suffix == ".mp4":
        try:
            export_to_video(list(frames.astype(np.float32) / 255.0), str(path), fps=fps)
        except ImportError as err:
            raise ValueError(f"writing {path.name} needs imageio and imageio-ffmpeg ({err}); use a .gif path") from err
    else:
        raise ValueError(f"output path {path} must end in .gif or .mp4")
    return path
