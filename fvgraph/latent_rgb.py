"""The latent-to-RGB map a step preview is drawn with: rgb = latents^T @ factors + bias, per latent pixel.

A diffusion model's latents are close enough to linear in the colours they decode to that one
channels x 3 matrix and a bias give a recognisable thumbnail at latent resolution, on the host, with
no VAE call (what ComfyUI and most UIs show while sampling). The map works on the normalized latents
the denoiser sees (the VAE's `(z - mean) / std` space) and gives RGB in [-1, 1], as the VAE's output.

A released card states its family's published factors (`LatentRgbSpec`, cards/latent_rgb_factors.py);
a card that embeds seeded weights has none published, so its map is fitted once from its own VAE
(`fit_latent_rgb`: least squares against the VAE's decode of random latents, deterministic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class LatentRgbSpec(BaseModel):
    """A card's published latent-to-RGB factors: `factors[c]` is channel c's (r, g, b) weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factors: tuple[tuple[float, float, float], ...] = Field(description="One (r, g, b) row per latent channel.")
    bias: tuple[float, float, float] = (0.0, 0.0, 0.0)
    source: str = Field(description="Where the numbers come from (a published file and version).")

    @model_validator(mode="after")
    def _some_channels(self) -> LatentRgbSpec:
        if not self.factors:
            raise ValueError("latent_rgb.factors must have one (r, g, b) row per latent channel; got none")
        return self


@dataclass(frozen=True)
class LatentRgbMap:
    """The map as tensors: `factors` [C, 3], `bias` [3] (float32, CPU). `fit_error` is the fitted map's
    RMS error against its VAE's decode over the decode's RMS (None for published factors)."""

    factors: torch.Tensor
    bias: torch.Tensor
    fit_error: float | None = None

    def __post_init__(self) -> None:
        # The image is made in numpy, float64: a preview is a few hundred numbers, where each torch op's
        # fixed cost (~10 us) would be most of the time.
        object.__setattr__(self, "_factors64", self.factors.double().numpy())
        object.__setattr__(self, "_bias64", self.bias.double().numpy())

    @classmethod
    def of(cls, spec: LatentRgbSpec) -> LatentRgbMap:
        return cls(torch.tensor(spec.factors, dtype=torch.float32), torch.tensor(spec.bias, dtype=torch.float32))

    @property
    def channels(self) -> int:
        return int(self.factors.shape[0])

    def rgb(self, frame: torch.Tensor) -> np.ndarray:
        """One latent frame [C, h, w] (host) -> RGB [h, w, 3] in about [-1, 1] (float64)."""
        latents = frame.numpy().astype(np.float64)
        return np.tensordot(latents, self._factors64, axes=(0, 0)) + self._bias64

    def image(self, frame: torch.Tensor) -> np.ndarray:
        """One latent frame [C, h, w] (host) -> uint8 RGB [h, w, 3], as the decoded video's [-1, 1] -> [0, 255]
        (rounded half to even, as torch.round)."""
        unit = np.clip(self.rgb(frame) / 2 + 0.5, 0.0, 1.0)
        return np.rint(unit * 255).astype(np.uint8)


def fit_latent_rgb(decode: Callable[[torch.Tensor], torch.Tensor], channels: int, spatial_scale: int,
                   samples: int = 8, size: int = 8, seed: int = 0) -> LatentRgbMap:  # fmt: skip
    """Least-squares latent-to-RGB map of a VAE. `decode` takes normalized latents [1, C, 1, h, w] and
    returns the decoded frame in [0, 1], [1, 3, 1, H, W]; each decode is averaged over the
    `spatial_scale` pixels of a latent pixel and the map fitted from the latents (plus a constant) to
    that colour in [-1, 1]. Random latents from a seeded CPU generator: the same VAE gives the same map."""
    generator = torch.Generator("cpu").manual_seed(seed)
    xs, ys = [], []
    for _ in range(samples):
        latents = torch.randn((1, channels, 1, size, size), generator=generator, dtype=torch.float32)
        decoded = decode(latents).float().cpu()[0, :, 0] * 2 - 1  # [3, H, W] in [-1, 1]
        colour = torch.nn.functional.avg_pool2d(decoded.unsqueeze(0), spatial_scale)[0]  # [3, h, w]
        xs.append(latents[0, :, 0].flatten(1).T)  # [h*w, C]
        ys.append(colour.flatten(1).T)  # [h*w, 3]
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    design = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    solution = torch.linalg.lstsq(design, y).solution  # [C + 1, 3]
    residual = design @ solution - y
    error = float(residual.square().mean().sqrt() / y.square().mean().sqrt())
    return LatentRgbMap(solution[:-1].float(), solution[-1].float(), fit_error=error)
