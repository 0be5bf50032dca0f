"""Step functions of the image-to-video loop's conditioning: the image through CLIP, the first frame
through the VAE. Each is a pure tensor function like the steps in steps.py (the denoise step itself
is steps.DenoiseStep, given the conditioning as two more inputs).
"""

from __future__ import annotations

import torch
from torch import nn


class ImageEncodeStep(nn.Module):
    """CLIP pixel values -> the vision tower's penultimate hidden states (what Wan 2.1 I2V attends to,
    as diffusers' WanImageToVideoPipeline.encode_image)."""

    def __init__(self, image_encoder: nn.Module):
        super().__init__()
        self.image_encoder = image_encoder

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.image_encoder(pixel_values=pixel_values, output_hidden_states=True)
        return {"image_embeds": out.hidden_states[-2]}


class VaeEncodeStep(nn.Module):
    """The first frame -> the condition the denoiser takes beside its latents, [B, T + C, f, h, w]:
    T mask channels (1 on the first latent frame, where the image is known) and the normalized VAE
    latents of a video whose first frame is the image and whose other frames are zero (diffusers'
    WanImageToVideoPipeline.prepare_latents, argmax of the posterior)."""

    def __init__(self, vae: nn.Module, temporal_scale: int):
        super().__init__()
        self.vae = vae
        self.temporal_scale = temporal_scale
        z_dim = vae.config.z_dim
        self.register_buffer("latents_mean", torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1))
        self.register_buffer("latents_inv_std", 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1))

    def forward(
        self,
        image: torch.Tensor,  # [B, 3, H, W] in [-1, 1]
        latents: torch.Tensor,  # [B, C, f, h, w]: read for its shape only (the latent frame count)
    ) -> dict[str, torch.Tensor]:
        encoded = self.vae.encode(self.video(image, latents), return_dict=False)[0].mode()
        return self.condition(encoded, latents)

    def video(self, image: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """What the VAE encodes: the image, then zero frames (a tiled encode runs this per tile of `image`)."""
        batch, _, frames, _, _ = latents.shape
        num_frames = (frames - 1) * self.temporal_scale + 1
        first = image.to(self.latents_mean.dtype).unsqueeze(2)
        return torch.cat([first, first.new_zeros(batch, 3, num_frames - 1, *image.shape[2:])], dim=2)

    def condition(self, encoded: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """The posterior's mode -> the normalized latents behind the first-frame mask."""
        batch, _, frames, h, w = latents.shape
        encoded = (encoded.float() - self.latents_mean.float()) * self.latents_inv_std.float()
        mask = torch.zeros(batch, self.temporal_scale, frames, h, w, dtype=encoded.dtype, device=encoded.device)
        mask[:, :, 0] = 1
        return {"condition": torch.cat([mask, encoded], dim=1)}


class FirstFrameEncodeStep(nn.Module):
    """The first frame alone -> its normalized VAE latents [B, C, 1, h, w], the argmax of the posterior
    (diffusers' WanImageToVideoPipeline.prepare_latents with `expand_timesteps`). They replace the
    first latent frame of the noise at every denoise step (steps.masked_frames)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        z_dim = vae.config.z_dim
        self.register_buffer("latents_mean", torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1))
        self.register_buffer("latents_inv_std", 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1))

    def forward(self, image: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """`image` [B, 3, H, W] in [-1, 1]; `latents` is the plan's shape witness and is not read."""
        encoded = self.vae.encode(self.video(image, latents), return_dict=False)[0].mode()
        return self.condition(encoded, latents)

    def video(self, image: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return image.to(self.latents_mean.dtype).unsqueeze(2)

    def condition(self, encoded: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"condition": (encoded.float() - self.latents_mean.float()) * self.latents_inv_std.float()}
