"""The encode steps of the Qwen-Image-Edit loop (fvgraph/loops/qwen_image_edit_loop.py): the
vision-language prompt with the image, and the image's latents. The denoise steps are Qwen-Image's
(qwen_image_steps.py), given the image's latents as `condition`.
"""

from __future__ import annotations

import torch
from torch import nn


class QwenEditTextEncodeStep(nn.Module):
    """Token ids (the template with the image's tokens expanded) and the image's patches -> Qwen2.5-VL's
    last hidden state [n, T, D], called as QwenImageEditPipeline._get_qwen_prompt_embeds calls it: ids,
    mask, pixel values and grid, and no `mm_token_type_ids`, so the language model takes plain positions.

    `pixel_values` [1, n * P, 1176] and `image_grid_thw` [1, n, 3] hold the n rows' images (the same image
    for each text of a request) batch-first, as a plan's inputs are; the encoder takes them flat."""

    def __init__(self, text_encoder: nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor,
                image_grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values.flatten(0, 1),
                                image_grid_thw=image_grid_thw.flatten(0, 1), output_hidden_states=True)  # fmt: skip
        return {"embeds": out.hidden_states[-1]}


class QwenEditEncodeStep(nn.Module):
    """The image -> its latents as QwenImageEditPipeline._encode_vae_image: the posterior's mode,
    normalised by the VAE's latents_mean and latents_std, [B, C, 1, h, w]. `video` and `condition`
    are the halves a tiled encode runs around its tiles (fvgraph/loops/tiled_coding.py)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        self.register_buffer("mean", torch.tensor(vae.config.latents_mean).view(shape), persistent=False)
        self.register_buffer("std", torch.tensor(vae.config.latents_std).view(shape), persistent=False)

    def forward(self, image: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """`image` [B, 3, H, W] in [-1, 1]; `latents` is the plan's shape witness and is not read."""
        encoded = self.vae.encode(self.video(image, latents), return_dict=False)[0].mode()
        return self.condition(encoded, latents)

    def video(self, image: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return image.unsqueeze(2).to(self.vae.dtype)  # a one-frame video, as the pipeline's image.unsqueeze(2)

    def condition(self, encoded: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        mean, std = self.mean.to(encoded.dtype), self.std.to(encoded.dtype)
        return {"condition": (encoded - mean) / std}
