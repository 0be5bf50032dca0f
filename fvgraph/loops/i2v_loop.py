"""The image-to-video loop of Wan 2.1 I2V: text_encode -> image_encode -> vae_encode -> denoise x N -> vae_decode.

As diffusers' WanImageToVideoPipeline: the image's CLIP embeddings (penultimate hidden states) join
the text in cross-attention, and the first frame's VAE latents with a first-frame mask are
concatenated to the latents' channels at every denoise step. Both are computed once per request, by
step kinds of their own (fvgraph/loops/i2v_steps.py), and then enter each denoise step as request
constants. Everything else (sampler, guidance, decode) is the text-to-video loop's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.video_processor import VideoProcessor
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.models.components import Components
from fvgraph.loops.i2v_steps import ImageEncodeStep, VaeEncodeStep
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.request import Request, RequestRejected
from fvgraph.loops.t2v_loop import STEP_KINDS as T2V_STEP_KINDS
from fvgraph.loops.t2v_loop import T2VState, TextToVideoLoop

IMAGE_ENCODE, VAE_ENCODE = "image_encode", "vae_encode"
STEP_KINDS = {
    **T2V_STEP_KINDS,
    IMAGE_ENCODE: StepKind(IMAGE_ENCODE, component="image_encoder", phase="image_encode",
                           inputs={"pixel_values": Role.STEP}, outputs={"image_embeds": Role.RESULT}),
    VAE_ENCODE: StepKind(VAE_ENCODE, component="vae", phase="vae_encode", inputs={"image": Role.STEP, "latents": Role.STEP},
                         outputs={"condition": Role.RESULT}),
}


@dataclass
class I2VState(T2VState):
    """T2VState plus the image conditioning: its inputs until encoded, then the encoded values."""

    clip_pixels: torch.Tensor | None = None  # [1, 3, S, S] CLIP pixel values, until image_encode ran
    image: torch.Tensor | None = None  # [1, 3, H, W] in [-1, 1], the first frame, until vae_encode ran
    image_embeds: torch.Tensor | None = None  # [1, N, D'] CLIP penultimate hidden states
    condition: torch.Tensor | None = None  # [1, T + C, f, h, w] first-frame mask + VAE latents


class ImageToVideoLoop(TextToVideoLoop):
    loop_id = "i2v"
    state_type = I2VState
    step_kinds = STEP_KINDS
    device_fields = (*TextToVideoLoop.device_fields, "clip_pixels", "image", "image_embeds", "condition")
    takes_image = True
    image_required = True  # a subclass whose model also runs from text alone sets False
    pre_denoise_phases = (IMAGE_ENCODE, VAE_ENCODE)

    def __init__(self, card: ModelCard, components: Components):
        super().__init__(card, components)
        if self.facts.image_dim is not None and components.image_encoder is None:
            raise ValueError(f"card {card.card_id!r}: the denoiser takes image embeddings (image_dim set) but no image_encoder loaded")
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial_scale)

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]:
        steps = super().build_steps(taps)
        c = self.components
        steps[VAE_ENCODE] = VaeEncodeStep(c.vae, self.temporal_scale).to(c.device).eval()
        if c.image_encoder is not None:
            steps[IMAGE_ENCODE] = ImageEncodeStep(c.image_encoder).to(c.device).eval()
        return steps

    def check_request(self, request: Request) -> Request:
        resolved = super().check_request(request)
        if self.image_required and resolved.image is None:
            raise RequestRejected("image", f"card {self.card.card_id!r} generates video from an image: pass image=...")
        return resolved

    def _warmup_inputs(self, height: int, width: int) -> dict:
        return {"image": torch.full((height, width, 3), 128, dtype=torch.uint8)}

    def _conditioning(self, request: Request, latents: torch.Tensor) -> dict:
        """Host-side preprocessing, as the diffusers pipeline does it (CPU, once per request)."""
        fields = {"image": self.video_processor.preprocess(request.image, height=request.height, width=request.width)}
        if self.facts.image_dim is not None:
            pixels = self.components.image_processor(images=request.image, return_tensors="pt").pixel_values
            fields["clip_pixels"] = pixels.to(self.components.device, next(self.components.image_encoder.parameters()).dtype)
        fields["image"] = fields["image"].to(self.components.device, torch.float32)
        return fields

    def _phase_after_text(self, state: I2VState) -> str:
        if state.clip_pixels is not None:
            return IMAGE_ENCODE
        return VAE_ENCODE if state.image is not None else "denoise"

    def next(self, state: I2VState) -> WorkPlan | object:
        if state.phase == IMAGE_ENCODE:
            return WorkPlan(state.request_id, IMAGE_ENCODE, {"pixel_values": state.clip_pixels})
        if state.phase == VAE_ENCODE:
            return WorkPlan(state.request_id, VAE_ENCODE, {"image": state.image, "latents": state.latents})
        return super().next(state)

    def advance(self, state: I2VState, result: StepResult) -> I2VState:
        if state.phase == IMAGE_ENCODE:
            state.image_embeds = result["image_embeds"].to(self.embed_dtype)
            state.clip_pixels = None
            state.phase = self._phase_after_text(state)
            return state
        if state.phase == VAE_ENCODE:
            state.condition = result["condition"]
            state.image = None
            state.phase = "denoise"
            return state
        return super().advance(state, result)

    def _conditioning_inputs(self, state: I2VState) -> dict[str, torch.Tensor]:
        inputs = {"condition": state.condition}
        if state.image_embeds is not None:
            inputs["image_embeds"] = state.image_embeds
        return inputs
