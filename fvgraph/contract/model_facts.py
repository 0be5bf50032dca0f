"""ModelFacts: what follows from the weights, read from the loaded components' own configs.

A card keeps recipe choices and limits; the widths, channel counts, patch size, VAE scale factors
and experts of the model come from the configs its weights were saved with (a checkpoint folder's
config.json files, or the card's seeded configs). A fine-tuned or resized checkpoint of a family
therefore loads with the family's card: requests are checked against its own widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFacts:
    text_dim: int  # width of the text embeddings the denoiser takes
    latent_channels: int  # the VAE's latent channels (z_dim)
    denoiser_in_channels: int  # what the denoiser's patch embedding takes (latents + any conditioning)
    patch_size: tuple[int, int, int]  # (t, h, w) of the denoiser's patch embedding
    vae_temporal: int  # frames per latent frame (after the first)
    vae_spatial: int  # pixels per latent pixel
    image_dim: int | None  # width of the image embeddings the denoiser takes (None: no image input)
    experts: tuple[str, ...]  # denoiser components present, in order of use ("transformer", "transformer_2")

    @property
    def spatial_multiple(self) -> int:
        """height and width must be multiples of this: one latent pixel per patch row."""
        return self.vae_spatial * self.patch_size[1]

    @property
    def temporal_multiple(self) -> int:
        """num_frames must be k * this + 1: the VAE keeps the first frame and packs the rest."""
        return self.vae_temporal

    @classmethod
    def of(cls, transformer: Any, vae: Any, transformer_2: Any = None) -> ModelFacts:
        """From loaded diffusers modules (their `.config` is what their weights were saved with).

        Video VAEs (z_dim, temporal downsampling) and image VAEs (latent_channels, one frame) both
        read here; an image denoiser that takes 2x2-packed latents (in_channels = 4 x the VAE's
        channels, patch_size 1: FLUX, Qwen-Image) counts that packing as its spatial patch."""
        dit, vae_cfg = transformer.config, vae.config
        if "spatial_compression_ratio" in vae_cfg:  # a video VAE that states its ratios (HunyuanVideo-1.5's)
            latent_channels = int(vae_cfg.latent_channels)
            temporal, spatial = int(vae_cfg.temporal_compression_ratio), int(vae_cfg.spatial_compression_ratio)
        elif "z_dim" in vae_cfg:
            latent_channels = int(vae_cfg.z_dim)
            downsample = list(vae_cfg.temperal_downsample)
            temporal = int(getattr(vae_cfg, "scale_factor_temporal", None) or 2 ** sum(downsample))
            spatial = int(getattr(vae_cfg, "scale_factor_spatial", None) or 2 ** len(downsample))
        else:  # an image VAE: one frame, 2 ** (levels - 1) pixels per latent pixel
            latent_channels, temporal = int(vae_cfg.latent_channels), 1
            spatial = 2 ** (len(vae_cfg.block_out_channels) - 1)
        patch = dit.patch_size
        if isinstance(patch, int) and "patch_size_t" in dit:  # (t, h, w) given as two ints
            patch = (dit.patch_size_t, patch, patch)
        if isinstance(patch, int):
            packed = 2 if patch == 1 and int(dit.in_channels) == 4 * latent_channels else patch
            patch = (1, packed, packed)
        text_dim = dit.get("text_dim") or dit.get("joint_attention_dim") or dit.get("text_embed_dim")
        return cls(
            text_dim=int(text_dim),
            latent_channels=latent_channels,
            denoiser_in_channels=int(dit.in_channels),
            patch_size=tuple(int(p) for p in patch),
            vae_temporal=temporal,
            vae_spatial=spatial,
            image_dim=None if dit.get("image_dim") is None else int(dit.image_dim),
            experts=("transformer",) if transformer_2 is None else ("transformer", "transformer_2"),
        )
