"""HunyuanVideo-1.5's image conditioning (image-to-video), as HunyuanVideo15ImageToVideoPipeline builds it.

- size: the image's bucket (`image_bucket`: the transformer's `target_size` area in steps of the VAE's
  spatial ratio, the aspect ratio nearest the image's), unless the request gives height and width;
  the image is resized to it and center-cropped, as the pipeline's video processor does;
- `image_encode`: SigLIP's last hidden state over the feature extractor's pixels of that image (the
  denoiser's image tokens, every one valid);
- `vae_encode`: the image encoded as one frame, the posterior's mode times the VAE's scaling factor,
  on latent frame 0 of zeros, beside a mask that is 1 on frame 0: the [cond latents, mask] channels
  the denoise step concatenates after its latents.
Both run once per request and enter every denoise step as request constants.
"""

from __future__ import annotations

from typing import Any

import PIL.Image
import torch
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.tiled_coding import VAE_ENCODE, VAE_ENCODE_KIND
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected

IMAGE_ENCODE = "image_encode"
IMAGE_ENCODE_KIND = StepKind(IMAGE_ENCODE, component="image_encoder", phase="image_encode",
                             inputs={"pixel_values": Role.STEP}, outputs={"image_embeds": Role.RESULT})  # fmt: skip


def image_processor(vae_spatial: int) -> HunyuanVideo15ImageProcessor:
    """The pipeline's video processor: no resize of its own (the image is cropped to its size first)."""
    return HunyuanVideo15ImageProcessor(vae_scale_factor=vae_spatial, do_resize=False, do_convert_rgb=True)


def image_bucket(image: PIL.Image.Image, target_size: int, vae_spatial: int) -> tuple[int, int]:
    """(height, width) HunyuanVideo15ImageToVideoPipeline generates at for `image`."""
    return image_processor(vae_spatial).calculate_default_height_width(image.size[1], image.size[0], target_size)


class SiglipEncodeStep(nn.Module):
    """Feature-extractor pixels -> SigLIP's last hidden state (the pipeline's _get_image_embeds)."""

    def __init__(self, image_encoder: nn.Module):
        super().__init__()
        self.image_encoder = image_encoder

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"image_embeds": self.image_encoder(pixel_values=pixel_values).last_hidden_state}


class HunyuanVaeEncodeStep(nn.Module):
    """The image [B, 3, H, W] in [-1, 1] -> `condition` [B, C + 1, F, h, w]: its latents (the posterior's
    mode times the scaling factor) on frame 0, zeros after, then the mask (1 on frame 0), as the
    pipeline's prepare_cond_latents_and_mask. `video` and `condition` are what a tiled encode runs."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, image: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """`latents` [B, C, F, h, w] is read for its frame count only."""
        encoded = self.vae.encode(self.video(image, latents), return_dict=False)[0].mode()
        return self.condition(encoded, latents)

    def video(self, image: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return image.to(self.vae.dtype).unsqueeze(2)  # one frame

    def condition(self, encoded: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        batch, _, frames, h, w = latents.shape
        first = (encoded * self.scaling_factor).float()  # [B, C, 1, h, w]
        rest = first.new_zeros(batch, first.shape[1], frames - 1, h, w)
        mask = first.new_zeros(batch, 1, frames, h, w)
        mask[:, :, 0] = 1.0
        return {"condition": torch.cat([torch.cat([first, rest], dim=2), mask], dim=1)}


class HunyuanFirstFrame:
    """The conditioning part: the request's `image` through SigLIP and through the VAE."""

    phases = (Phase.IMAGE_ENCODE, Phase.VAE_ENCODE)
    step_kinds = {IMAGE_ENCODE: IMAGE_ENCODE_KIND, VAE_ENCODE: VAE_ENCODE_KIND}
    reads = ("image",)
    device_fields = ("siglip_pixels", "image", "image_embeds", "condition")

    def __init__(self, card: ModelCard, components: Components):
        if components.image_encoder is None or components.image_processor is None:
            raise ValueError(f"card {card.card_id!r} conditions on SigLIP's image embeddings: build it with its image_encoder "
                             "and feature_extractor")  # fmt: skip
        self.card, self.components = card, components
        self.processor = image_processor(components.facts.vae_spatial)

    def build(self, components: Components) -> dict[str, nn.Module]:
        return {IMAGE_ENCODE: SiglipEncodeStep(components.image_encoder), VAE_ENCODE: HunyuanVaeEncodeStep(components.vae)}

    def check(self, resolved: Request) -> None:
        if resolved.image is None:
            raise RequestRejected("image", f"card {self.card.card_id!r} generates video from an image: pass image=... "
                                           "(a PIL image or a uint8 array [H, W, 3])")  # fmt: skip

    def init_fields(self, request: Request, latents: torch.Tensor) -> dict[str, Any]:
        """Host-side preprocessing, as the pipeline's (CPU, once per request): the image cropped to the
        request's size, for the VAE in [-1, 1], and through the feature extractor for SigLIP."""
        device, encoder = self.components.device, self.components.image_encoder
        image = self.processor.resize(request.image, height=request.height, width=request.width, resize_mode="crop")
        pixels = self.components.image_processor.preprocess(images=image, do_resize=True, return_tensors="pt",
                                                            do_convert_rgb=True).pixel_values  # fmt: skip
        vae_image = self.processor.preprocess(image, height=request.height, width=request.width)
        return {"siglip_pixels": pixels.to(device, next(encoder.parameters()).dtype), "image": vae_image.to(device, torch.float32)}

    def first_phase(self, state: Any) -> Phase | None:
        if state.siglip_pixels is not None:
            return Phase.IMAGE_ENCODE
        return Phase.VAE_ENCODE if state.image is not None else None

    def plan(self, state: Any) -> WorkPlan:
        if state.phase == Phase.IMAGE_ENCODE:
            return WorkPlan(state.request_id, IMAGE_ENCODE, {"pixel_values": state.siglip_pixels})
        return WorkPlan(state.request_id, VAE_ENCODE, {"image": state.image, "latents": state.latents})

    def take(self, state: Any, result: StepResult) -> None:
        if state.phase == Phase.IMAGE_ENCODE:
            state.image_embeds = result["image_embeds"].to(self.components.transformer.dtype)
            state.siglip_pixels = None
        else:
            state.condition, state.image = result["condition"], None
        state.phase = self.first_phase(state) or Phase.DENOISE

    def constants(self, state: Any) -> dict[str, torch.Tensor]:
        return {"condition": state.condition, "image_embeds": state.image_embeds}

    def after_last_step(self, state: Any) -> None:
        pass

    def check_saved(self, state: Any) -> None:
        if state.phase == Phase.DENOISE and (state.condition is None or state.image_embeds is None):
            missing = "condition" if state.condition is None else "image_embeds"
            raise ValueError(f"{missing}: a state past its image's encodes must hold it")

    def warmup_inputs(self, height: int, width: int) -> dict[str, Any]:
        return {"image": torch.full((height, width, 3), 128, dtype=torch.uint8)}
