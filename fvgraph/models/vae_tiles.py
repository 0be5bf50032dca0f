"""Tiled VAE decode and encode, one tile at a time, as diffusers' `vae.enable_tiling(...)` runs them.

diffusers decodes every tile, then blends each with the tile above and the one to its left (in
place, in row-major order) and crops it to the stride. Blending tile (i, j) reads only tiles
(i - 1, j) and (i, j - 1), already blended by then, so the same result comes out when each tile is
blended as soon as it is decoded (fvgraph/loops/tiled_coding.py), keeping one row of tiles instead of
all of them. What differs per VAE class lives here: its tile grid, the settings it takes, how one
tile runs through its decoder (or encoder) and what follows the blend.

    tiling = vae_tiling(vae, True)              # diffusers' defaults for the class
    tiling = vae_tiling(vae, {"tile_sample_min_height": 128, ...})   # its enable_tiling keywords
    grid = tiling.decode_grid(h, w)             # None: below one tile, diffusers decodes untiled
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TileGrid:
    """Where the tiles of one decode (or encode) are, and how they are stitched.

    `rows` / `cols` are the input windows; `blend` the (height, width) overlap blended into the next
    tile and `keep` what of each blended tile is kept, both in the output's units; `size` the final
    crop (None: none, as AutoencoderKL)."""

    rows: tuple[slice, ...]
    cols: tuple[slice, ...]
    blend: tuple[int, int]
    keep: tuple[int, int]
    size: tuple[int, int] | None

    def __len__(self) -> int:
        return len(self.rows) * len(self.cols)

    def window(self, index: int) -> tuple[slice, slice]:
        """The (rows, cols) input window of tile `index`, row-major."""
        return self.rows[index // len(self.cols)], self.cols[index % len(self.cols)]


def _windows(extent: int, stride: int, size: int, scale: int = 1) -> tuple[slice, ...]:
    """Windows of `size` every `stride` over `extent`, in units `scale` times smaller than the input's."""
    return tuple(slice(i * scale, (i + size) * scale) for i in range(0, extent, stride))


def _overlap_grid(height: int, width: int, size: tuple[int, int], out: tuple[int, int], overlap: float) -> TileGrid | None:
    """The grid of diffusers' overlap-factor tiling (AutoencoderKL, AutoencoderKLHunyuanVideo15): input
    windows of `size` (height, width) every (1 - overlap) of it; each tile comes out `out` large and
    blends `overlap` of it with the tile before, no final crop. None below one tile (diffusers then
    encodes or decodes untiled)."""
    if not (width > size[1] or height > size[0]):
        return None
    blend = (int(out[0] * overlap), int(out[1] * overlap))
    return TileGrid(_windows(height, int(size[0] * (1 - overlap)), size[0]), _windows(width, int(size[1] * (1 - overlap)), size[1]),
                    blend, (out[0] - blend[0], out[1] - blend[1]), None)  # fmt: skip


class VaeTiling(abc.ABC):
    """What tiling means for one VAE class; `settings` are its enable_tiling keywords in effect."""

    settings: dict[str, int]

    def __init__(self, vae: nn.Module):
        self.vae = vae

    @abc.abstractmethod
    def decode_grid(self, height: int, width: int) -> TileGrid | None: ...

    @abc.abstractmethod
    def decode_tile(self, z: torch.Tensor) -> torch.Tensor: ...

    def decoded(self, stitched: torch.Tensor) -> torch.Tensor:
        """What follows the blend in diffusers' tiled decode (unpatchify, clamp), on the stitched output."""
        return stitched

    @abc.abstractmethod
    def encode_grid(self, height: int, width: int) -> TileGrid | None:
        """The encode's tiles, in the input's pixels (None: below one tile, diffusers encodes untiled)."""

    @abc.abstractmethod
    def encode_tile(self, x: torch.Tensor) -> torch.Tensor:
        """One tile of the input -> its moments, before blending."""

    def blend(self, above: torch.Tensor | None, left: torch.Tensor | None, tile: torch.Tensor, grid: TileGrid) -> torch.Tensor:
        """`tile` blended in place with its blended neighbours, by the VAE's own blend functions."""
        if above is not None:
            tile = self.vae.blend_v(above, tile, grid.blend[0])
        if left is not None:
            tile = self.vae.blend_h(left, tile, grid.blend[1])
        return tile


class CausalVideoTiling(VaeTiling):
    """AutoencoderKLWan and AutoencoderKLQwenImage: tiles over height and width, each tile decoded
    (encoded) through every frame with the causal conv cache cleared at its start."""

    KEYS = ("tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height", "tile_sample_stride_width")

    def __init__(self, vae: nn.Module, options: dict[str, Any]):
        super().__init__(vae)
        # enable_tiling's rule: a keyword given and not None replaces the default set in the VAE's __init__.
        self.settings = {key: int(options.get(key) or getattr(vae, key)) for key in self.KEYS}
        self.ratio = int(vae.spatial_compression_ratio)
        self.patch = getattr(vae.config, "patch_size", None)
        for side in ("height", "width"):
            size, stride = self.settings[f"tile_sample_min_{side}"], self.settings[f"tile_sample_stride_{side}"]
            for key, value in ((f"tile_sample_min_{side}", size), (f"tile_sample_stride_{side}", stride)):
                if value <= 0 or value % self.ratio:
                    raise ValueError(f"vae_tiling.{key}={value}: must be a positive multiple of the VAE's spatial "
                                     f"compression ratio {self.ratio}, so tiles fall on whole latents")  # fmt: skip
            if stride > size:
                raise ValueError(f"vae_tiling.tile_sample_stride_{side}={stride}: must be <= tile_sample_min_{side}={size}, "
                                 "or the tiles would leave gaps")  # fmt: skip
        # Wan 2.1's decoder takes `first_chunk`; Qwen-Image's does not.
        self._first_chunk = "first_chunk" in inspect.signature(vae.decoder.forward).parameters

    def decode_grid(self, height: int, width: int) -> TileGrid | None:
        s, r, p = self.settings, self.ratio, self.patch or 1
        size_h, size_w = s["tile_sample_min_height"] // r, s["tile_sample_min_width"] // r
        if not (width > size_w or height > size_h):
            return None  # diffusers' _decode: untiled
        stride_h, stride_w = s["tile_sample_stride_height"] // p, s["tile_sample_stride_width"] // p
        return TileGrid(rows=_windows(height, s["tile_sample_stride_height"] // r, size_h),
                        cols=_windows(width, s["tile_sample_stride_width"] // r, size_w),
                        blend=(s["tile_sample_min_height"] // p - stride_h, s["tile_sample_min_width"] // p - stride_w),
                        keep=(stride_h, stride_w), size=(height * r // p, width * r // p))  # fmt: skip

    def decode_tile(self, z: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        vae.clear_cache()
        frames = []
        for k in range(z.shape[2]):
            vae._conv_idx = [0]
            tile = vae.post_quant_conv(z[:, :, k : k + 1])
            extra = {"first_chunk": k == 0} if self._first_chunk else {}
            frames.append(vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, **extra))
        vae.clear_cache()  # the conv cache holds a frame's activations: not kept between steps
        return torch.cat(frames, dim=2)

    def decoded(self, stitched: torch.Tensor) -> torch.Tensor:
        if self.patch is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            stitched = unpatchify(stitched, patch_size=self.patch)
        # Wan's tiled decode clamps; Qwen-Image's does not (its postprocess clamps either way).
        return torch.clamp(stitched, min=-1.0, max=1.0) if self._first_chunk else stitched

    def encode_grid(self, height: int, width: int) -> TileGrid | None:
        """The tiles of a `height` x `width` input in pixels. diffusers tiles the patchified input
        (Wan 2.2's VAE); a window here is the pixels that patchify to its window there."""
        s, p = self.settings, self.patch or 1
        if not (width > s["tile_sample_min_width"] or height > s["tile_sample_min_height"]):
            return None  # diffusers' _encode (which compares the input's size before patchifying): untiled
        height, width = height // p, width // p
        r = self.ratio // p
        size_h, size_w = s["tile_sample_min_height"] // r, s["tile_sample_min_width"] // r
        stride_h, stride_w = s["tile_sample_stride_height"] // r, s["tile_sample_stride_width"] // r
        return TileGrid(rows=_windows(height, s["tile_sample_stride_height"], s["tile_sample_min_height"], p),
                        cols=_windows(width, s["tile_sample_stride_width"], s["tile_sample_min_width"], p),
                        blend=(size_h - stride_h, size_w - stride_w), keep=(stride_h, stride_w),
                        size=(height // r, width // r))  # fmt: skip

    def encode_tile(self, x: torch.Tensor) -> torch.Tensor:
        """One tile of the pixels [B, C, T, h, w] -> its moments [B, 2 z, t, h', w'] (first
        frame alone, then groups of four, as diffusers' tiled_encode)."""
        vae = self.vae
        if self.patch is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

            x = patchify(x, patch_size=self.patch)
        vae.clear_cache()
        chunks = []
        for k in range(1 + (x.shape[2] - 1) // 4):
            vae._enc_conv_idx = [0]
            tile = x[:, :, :1] if k == 0 else x[:, :, 1 + 4 * (k - 1) : 1 + 4 * k]
            tile = vae.encoder(tile, feat_cache=vae._enc_feat_map, feat_idx=vae._enc_conv_idx)
            chunks.append(vae.quant_conv(tile))
        vae.clear_cache()
        return torch.cat(chunks, dim=2)


class ImageTiling(VaeTiling):
    """AutoencoderKL (FLUX.1, FLUX.1 Kontext's encode too): square tiles of its config's sample_size,
    overlap 0.25."""

    def __init__(self, vae: nn.Module, options: dict[str, Any]):
        super().__init__(vae)
        if options:
            raise ValueError(f"vae_tiling: {type(vae).__name__}.enable_tiling() takes no settings (got {sorted(options)}); "
                             "pass vae_tiling=True")  # fmt: skip
        self.settings = {}

    def decode_grid(self, height: int, width: int) -> TileGrid | None:
        vae = self.vae
        latent, sample = (vae.tile_latent_min_size,) * 2, (vae.tile_sample_min_size,) * 2
        return _overlap_grid(height, width, latent, sample, vae.tile_overlap_factor)

    def decode_tile(self, z: torch.Tensor) -> torch.Tensor:
        if self.vae.config.use_post_quant_conv:
            z = self.vae.post_quant_conv(z)
        return self.vae.decoder(z)

    def encode_grid(self, height: int, width: int) -> TileGrid | None:
        """AutoencoderKL's `_tiled_encode`: pixel windows of `tile_sample_min_size` every (1 - overlap)
        of it, blended and kept in latent units, no final crop."""
        vae = self.vae
        sample, latent = (vae.tile_sample_min_size,) * 2, (vae.tile_latent_min_size,) * 2
        return _overlap_grid(height, width, sample, latent, vae.tile_overlap_factor)

    def encode_tile(self, x: torch.Tensor) -> torch.Tensor:
        """One tile of the image [B, 3, h, w] -> its moments [B, 2 z, h', w']."""
        moments = self.vae.encoder(x)
        return self.vae.quant_conv(moments) if self.vae.config.use_quant_conv else moments


class OverlapTiling(VaeTiling):
    """AutoencoderKLHunyuanVideo15: tiles over height and width with their own sizes in pixels and in
    latents and one overlap factor (diffusers' default 0.25), each tile through the whole encoder or decoder (every frame
    at once), no final crop."""

    KEYS = ("tile_sample_min_height", "tile_sample_min_width", "tile_latent_min_height", "tile_latent_min_width",
            "tile_overlap_factor")  # fmt: skip

    def __init__(self, vae: nn.Module, options: dict[str, Any]):
        super().__init__(vae)
        # enable_tiling's rule: a keyword given and not None replaces the default set in the VAE's __init__.
        self.settings = {key: options.get(key) or getattr(vae, key) for key in self.KEYS}
        overlap = self.settings["tile_overlap_factor"]
        if not 0 <= overlap < 1:
            raise ValueError(f"vae_tiling.tile_overlap_factor={overlap}: must be in [0, 1), the share of a tile its neighbour overlaps")
        for key in self.KEYS[:4]:
            value = self.settings[key]
            if not isinstance(value, int) or int(value * (1 - overlap)) < 1:
                raise ValueError(f"vae_tiling.{key}={value}: must be a whole number whose non-overlapping part, "
                                 f"{key} x (1 - tile_overlap_factor), is at least 1")  # fmt: skip

    def _grid(self, height: int, width: int, size: str, blended: str) -> TileGrid | None:
        """diffusers' tiled_encode (size "sample", blended "latent") or tiled_decode (the other way round)."""
        s = self.settings
        return _overlap_grid(height, width, (s[f"tile_{size}_min_height"], s[f"tile_{size}_min_width"]),
                             (s[f"tile_{blended}_min_height"], s[f"tile_{blended}_min_width"]), s["tile_overlap_factor"])  # fmt: skip

    def decode_grid(self, height: int, width: int) -> TileGrid | None:
        return self._grid(height, width, "latent", "sample")

    def decode_tile(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decoder(z)

    def encode_grid(self, height: int, width: int) -> TileGrid | None:
        return self._grid(height, width, "sample", "latent")

    def encode_tile(self, x: torch.Tensor) -> torch.Tensor:
        """One tile of the pixels [B, C, T, h, w] -> its moments (the encoder returns them whole)."""
        return self.vae.encoder(x)


def vae_tiling(vae: nn.Module, option: bool | dict[str, Any] | None) -> VaeTiling | None:
    """The tiling `option` asks of `vae` (None / False: none); ValueError names `vae_tiling` and the rule."""
    if option is None or option is False:
        return None
    if option is not True and not isinstance(option, dict):
        raise ValueError(f"vae_tiling={option!r}: pass True (diffusers' defaults) or a dict of enable_tiling keywords")
    options = {} if option is True else dict(option)
    allowed = [name for name in inspect.signature(type(vae).enable_tiling).parameters if name != "self"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) or "no settings"
        raise ValueError(f"vae_tiling: {type(vae).__name__}.enable_tiling takes {takes}; unknown: {', '.join(unknown)}")
    if hasattr(vae, "tile_sample_stride_height") and hasattr(vae, "clear_cache"):
        return CausalVideoTiling(vae, options)
    if hasattr(vae, "tile_latent_min_height"):
        return OverlapTiling(vae, options)
    if hasattr(vae, "tile_latent_min_size"):
        return ImageTiling(vae, options)
    raise ValueError(f"vae_tiling: fvgraph does not tile a {type(vae).__name__}")
