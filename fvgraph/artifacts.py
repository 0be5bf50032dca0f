"""What a request produced, as typed artifacts that each say how they were made.

`Result.artifacts` lists them: the final latents always (`LatentArtifact`), and the decoded output as
a `VideoArtifact` (frames and their frame rate) or, on an image card, an `ImageArtifact`. Each
carries a `Provenance`: the card, the weights version (merged adapters included), the request's
adapters, the recipe in effect, the precision, the opt level, the parallel plan, the seed and the
step that produced it. `Result.frames` / `.images` / `.latents` stay as they were; the artifacts
hold the same arrays (no copy). Each artifact checks itself when built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch


def _need(ok: bool, what: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{what}: {rule}")


@dataclass(frozen=True)
class Provenance:
    """How an artifact was made. `produced_by` names the stage that made it: "denoise" for latents, with
    `step` the 1-based denoise step that made them (the last), or "vae_decode" (step None)."""

    card_id: str
    weights_version: str
    precision: str
    opt_level: int
    parallel: str  # "single", or the split ("cfg2xulysses1")
    seed: int
    produced_by: str
    step: int | None = None
    recipe: Mapping[str, Any] = field(default_factory=dict)
    adapters: Mapping[str, float] = field(default_factory=dict)  # the request's LoRA adapters, name -> scale
    adapter_digests: Mapping[str, str] = field(default_factory=dict)
    merged_adapters: Mapping[str, Any] = field(default_factory=dict)  # adapters merged into the weights

    def __post_init__(self) -> None:
        for name in ("card_id", "weights_version", "precision", "parallel", "produced_by"):
            _need(isinstance(getattr(self, name), str), "provenance", f"{name} must be a string, got {getattr(self, name)!r}")
        _need(isinstance(self.opt_level, int) and 0 <= self.opt_level <= 3, "provenance", f"opt_level must be 0..3, got {self.opt_level!r}")
        _need(isinstance(self.seed, int), "provenance", f"seed must be an int, got {self.seed!r}")
        _need(self.step is None or (isinstance(self.step, int) and self.step >= 1), "provenance", f"step must be None or >= 1, got {self.step!r}")
        for name in ("recipe", "adapters", "adapter_digests", "merged_adapters"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


def _check_rgb(what: str, name: str, value: object) -> None:
    _need(isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 4 and value.shape[-1] == 3
          and value.shape[0] >= 1, what, f"{name} must be uint8 [N, H, W, 3] with N >= 1, got "
          f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else f"{name} must be a numpy array")  # fmt: skip


@dataclass(frozen=True)
class VideoArtifact:
    """A video: `frames` uint8 [T, H, W, 3] at `fps` frames per second."""

    frames: np.ndarray = field(repr=False)
    fps: float
    provenance: Provenance

    def __post_init__(self) -> None:
        _check_rgb("video artifact", "frames", self.frames)
        _need(isinstance(self.fps, (int, float)) and 0 < self.fps <= 120, "video artifact", f"fps must be in (0, 120], got {self.fps!r}")


@dataclass(frozen=True)
class ImageArtifact:
    """Images: `images` uint8 [N, H, W, 3]."""

    images: np.ndarray = field(repr=False)
    provenance: Provenance

    def __post_init__(self) -> None:
        _check_rgb("image artifact", "images", self.images)


@dataclass(frozen=True)
class LatentArtifact:
    """The final latents, normalized as the denoiser sees them: [1, C, F, h, w] (CPU)."""

    latents: torch.Tensor = field(repr=False)
    provenance: Provenance

    def __post_init__(self) -> None:
        _need(isinstance(self.latents, torch.Tensor) and self.latents.dim() == 5 and self.latents.is_floating_point(),
              "latent artifact", "latents must be a floating tensor [1, C, F, h, w]")  # fmt: skip
