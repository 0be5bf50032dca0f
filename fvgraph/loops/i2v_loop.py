"""The image-to-video loop of Wan 2.1 I2V: text_encode -> image_encode -> vae_encode -> denoise x N -> vae_decode.

As diffusers' WanImageToVideoPipeline: the image's CLIP embeddings (penultimate hidden states) join
the text in cross-attention, and the first frame's VAE latents with a first-frame mask are
concatenated to the latents' channels at every denoise step. Both are computed once per request, by
step kinds of their own (fvgraph/loops/i2v_steps.py), and then enter each denoise step as request
constants: `FirstFrameImage`, a conditioning part. Everything else is the text-to-video loop's parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.video_processor import VideoProcessor
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.denoise_loop import DenoiseLoop
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.i2v_steps import ImageEncodeStep, VaeEncodeStep
from fvgraph.loops.steps import ConcatCondition
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.loops.t2v_loop import STEP_KINDS as T2V_STEP_KINDS
from fvgraph.loops.t2v_loop import WAN_DECODER
from fvgraph.loops.tiled_coding import VAE_ENCODE, VAE_ENCODE_KIND
from fvgraph.loops.wan_parts import VideoLatents, WanDenoiser, WanText
from fvgraph.models.components import Components
from fvgraph.models.wan_projections import apply_projection_cache
from fvgraph.request import Request, RequestRejected

IMAGE_ENCODE = "image_encode"
IMAGE_ENCODE_KIND = StepKind(IMAGE_ENCODE, component="image_encoder", phase="image_encode",
                             inputs={"pixel_values": Role.STEP}, outputs={"image_embeds": Role.RESULT})  # fmt: skip
STEP_KINDS = {**T2V_STEP_KINDS, IMAGE_ENCODE: IMAGE_ENCODE_KIND, VAE_ENCODE: VAE_ENCODE_KIND}
CACHING_REFUSED = "step caching runs on single-expert loops only: the denoiser sections it runs on are one transformer's"


@dataclass
class I2VState(DenoiseState):
    """DenoiseState plus the image conditioning: its inputs until encoded, then the encoded values."""

    clip_pixels: torch.Tensor | None = None  # [1, 3, S, S] CLIP pixel values, until image_encode ran
    image: torch.Tensor | None = None  # [1, 3, H, W] in [-1, 1], the first frame, until vae_encode ran
    image_embeds: torch.Tensor | None = None  # [1, N, D'] CLIP penultimate hidden states
    condition: torch.Tensor | None = None  # [1, T + C, f, h, w] first-frame mask + VAE latents


class FirstFrameImage:
    """Wan 2.1 I2V's image: CLIP embeddings (where the denoiser takes them) and the first frame's VAE
    latents with a mask, concatenated to the latents' channels."""

    phases = (Phase.IMAGE_ENCODE, Phase.VAE_ENCODE)
    step_kinds = {IMAGE_ENCODE: IMAGE_ENCODE_KIND, VAE_ENCODE: VAE_ENCODE_KIND}
    reads = ("image",)
    device_fields = ("clip_pixels", "image", "image_embeds", "condition")

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components, self.facts = card, components, components.facts
        if self.facts.image_dim is not None and components.image_encoder is None:
            raise ValueError(f"card {card.card_id!r}: the denoiser takes image embeddings (image_dim set) but no image_encoder loaded")
        self.video_processor = VideoProcessor(vae_scale_factor=self.facts.vae_spatial)

    def build(self, components: Components) -> dict[str, nn.Module]:
        steps = {VAE_ENCODE: VaeEncodeStep(components.vae, self.facts.vae_temporal)}
        if components.image_encoder is not None:
            steps[IMAGE_ENCODE] = ImageEncodeStep(components.image_encoder)
        return steps

    def check(self, resolved: Request) -> None:
        if resolved.image is None:
            raise RequestRejected("image", f"card {self.card.card_id!r} generates video from an image: pass image=...")

    def init_fields(self, request: Request, latents: torch.Tensor) -> dict[str, Any]:
        """Host-side preprocessing, as the diffusers pipeline does it (CPU, once per request)."""
        device = self.components.device
        fields = {"image": self.video_processor.preprocess(request.image, height=request.height, width=request.width)}
        if self.facts.image_dim is not None:
            pixels = self.components.image_processor(images=request.image, return_tensors="pt").pixel_values
            fields["clip_pixels"] = pixels.to(device, next(self.components.image_encoder.parameters()).dtype)
        fields["image"] = fields["image"].to(device, torch.float32)
        return fields

    def first_phase(self, state: I2VState) -> Phase | None:
        if state.clip_pixels is not None:
            return Phase.IMAGE_ENCODE
        return Phase.VAE_ENCODE if state.image is not None else None

    def plan(self, state: I2VState) -> WorkPlan:
        if state.phase == Phase.IMAGE_ENCODE:
            return WorkPlan(state.request_id, IMAGE_ENCODE, {"pixel_values": state.clip_pixels})
        return WorkPlan(state.request_id, VAE_ENCODE, {"image": state.image, "latents": state.latents})

    def take(self, state: I2VState, result: StepResult) -> None:
        if state.phase == Phase.IMAGE_ENCODE:
            state.image_embeds = result["image_embeds"].to(self.components.transformer.dtype)
            state.clip_pixels = None
            state.phase = self.first_phase(state) or Phase.DENOISE
        else:
            state.condition = result["condition"]
            state.image = None
            state.phase = Phase.DENOISE

    def constants(self, state: I2VState) -> dict[str, torch.Tensor]:
        inputs = {"condition": state.condition}
        if state.image_embeds is not None:
            inputs["image_embeds"] = state.image_embeds
        return inputs

    def after_last_step(self, state: I2VState) -> None:
        pass

    def check_saved(self, state: I2VState) -> None:
        pass

    def warmup_inputs(self, height: int, width: int) -> dict[str, Any]:
        return {"image": torch.full((height, width, 3), 128, dtype=torch.uint8)}


def i2v_parts(loop_id: str, state_type: type, card: ModelCard, components: Components, two_experts: bool = False) -> FamilyParts:
    return FamilyParts(loop_id, state_type, WanText(card, components), WanDenoiser(card, components, two_experts, ConcatCondition()),
                       VideoLatents(), WAN_DECODER, FirstFrameImage(card, components),
                       caching_refused=f"card {card.card_id!r} runs loop {loop_id!r}; {CACHING_REFUSED}" if two_experts else None,
                       # Wan 2.1 I2V's cross-attention input is a per-step concat with the image tokens: no layout.
                       projection_layout=None if components.facts.image_dim is not None else apply_projection_cache)  # fmt: skip


class ImageToVideoLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        super().__init__(card, components, i2v_parts("i2v", I2VState, card, components), config)
