"""The text-and-image-to-video loop of Wan 2.2 TI2V-5B: one model, with or without a first frame.

As diffusers' WanPipeline and WanImageToVideoPipeline with `expand_timesteps=True`. Where Wan 2.1
I2V concatenates the image's latents to the noise's channels, here the image is the first latent
frame itself: at every denoise step the given frame replaces the noise there (a frame mask, 0 on
given frames), and the denoiser takes one timestep per token, 0 on the given frame's tokens
(steps.masked_frames). The sampler updates the whole noise as usual; the given frame is put back
once, after the last step. A request without an image runs the same step with a mask of ones and
per-token timesteps that all equal the step's (what WanPipeline feeds this model), so text-only and
image requests batch into one graph.

Phases: text_encode -> vae_encode (image requests only) -> denoise x N -> vae_decode.
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
from fvgraph.loops.denoise_loop import DenoiseLoop
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.tiled_coding import VAE_ENCODE, VAE_ENCODE_KIND
from fvgraph.loops.i2v_loop import STEP_KINDS as I2V_STEP_KINDS
from fvgraph.loops.i2v_steps import FirstFrameEncodeStep
from fvgraph.loops.steps import GivenFrames
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.loops.t2v_loop import WAN_DECODER
from fvgraph.loops.wan_parts import VideoLatents, WanDenoiser, WanText
from fvgraph.models.components import Components
from fvgraph.models.wan_projections import apply_projection_cache
from fvgraph.request import Request

STEP_KINDS = {kind: spec for kind, spec in I2V_STEP_KINDS.items() if spec.component != "image_encoder"}


@dataclass
class TI2VState(DenoiseState):
    """DenoiseState plus the first frame: `image` until encoded, then `condition`, its latents
    [1, C, 1, h, w] (zeros for a text-only request); `frame_mask` [1, 1, f, h, w] is 0 on given
    latent frames, 1 elsewhere."""

    image: torch.Tensor | None = None  # [1, 3, H, W] in [-1, 1], until vae_encode ran
    condition: torch.Tensor | None = None
    frame_mask: torch.Tensor | None = None


class OptionalFirstFrame:
    """TI2V's optional image: the first latent frame, given at every denoise step."""

    phases = (Phase.VAE_ENCODE,)
    step_kinds = {VAE_ENCODE: VAE_ENCODE_KIND}
    reads = ("image",)
    device_fields = ("image", "condition", "frame_mask")

    def __init__(self, card: ModelCard, components: Components):
        facts = components.facts
        if facts.denoiser_in_channels != facts.latent_channels:
            raise ValueError(
                f"card {card.card_id!r}: loop 'ti2v' gives the first frame as latents, so the denoiser must take "
                f"exactly the VAE's {facts.latent_channels} latent channels; its weights take {facts.denoiser_in_channels}"
            )
        if facts.image_dim is not None:
            raise ValueError(f"card {card.card_id!r}: loop 'ti2v' has no image encoder, but the denoiser takes "
                             f"image embeddings (image_dim={facts.image_dim})")  # fmt: skip
        self.components = components
        self.video_processor = VideoProcessor(vae_scale_factor=facts.vae_spatial)

    def build(self, components: Components) -> dict[str, nn.Module]:
        return {VAE_ENCODE: FirstFrameEncodeStep(components.vae)}

    def check(self, resolved: Request) -> None:
        pass

    def init_fields(self, request: Request, latents: torch.Tensor) -> dict[str, Any]:
        """The frame mask, and the given frame: zeros for a text-only request; an image request's comes
        from the vae_encode step."""
        _, channels, frames, h, w = latents.shape
        device = self.components.device
        mask = torch.ones(1, 1, frames, h, w, device=device)
        if request.image is None:
            return {"frame_mask": mask, "condition": torch.zeros(1, channels, 1, h, w, device=device)}
        mask[:, :, 0] = 0
        image = self.video_processor.preprocess(request.image, height=request.height, width=request.width)
        return {"image": image.to(device, torch.float32), "frame_mask": mask}

    def first_phase(self, state: TI2VState) -> Phase | None:
        return Phase.VAE_ENCODE if state.image is not None else None

    def plan(self, state: TI2VState) -> WorkPlan:
        return WorkPlan(state.request_id, VAE_ENCODE, {"image": state.image, "latents": state.latents})

    def take(self, state: TI2VState, result: StepResult) -> None:
        state.condition, state.image = result["condition"], None
        state.phase = Phase.DENOISE

    def constants(self, state: TI2VState) -> dict[str, torch.Tensor]:
        return {"first_frame": state.condition, "frame_mask": state.frame_mask}

    def after_last_step(self, state: TI2VState) -> None:
        """The given frame back in place of the denoised one (as the pipeline does)."""
        if state.frame_mask is not None:
            state.latents = (1 - state.frame_mask) * state.condition + state.frame_mask * state.latents
            state.frame_mask = state.condition = None

    def check_saved(self, state: TI2VState) -> None:
        """Until the last denoise step ran: a mask of the latents' frames holding only 0 and 1, and a
        given frame of the latents' channels and size."""
        if state.phase in (Phase.DECODE, Phase.DONE) and state.frame_mask is None and state.condition is None:
            return
        _, channels, frames, h, w = state.latents.shape
        for name, shape in (("frame_mask", (1, 1, frames, h, w)), ("condition", (1, channels, 1, h, w))):
            value = getattr(state, name)
            if name == "condition" and value is None and state.image is not None:
                continue  # the image is still to encode
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or not value.is_floating_point() \
                    or not torch.isfinite(value).all():  # fmt: skip
                got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"state of request {state.request_id!r}: {name}: must be a finite float tensor "
                                 f"of shape {list(shape)}, got {got}")  # fmt: skip
        if not ((state.frame_mask == 0) | (state.frame_mask == 1)).all():
            raise ValueError(f"state of request {state.request_id!r}: frame_mask: must hold only 0 and 1")

    def warmup_inputs(self, height: int, width: int) -> dict[str, Any]:
        return {}  # a text-only request runs the same denoise step; `fvgraph warmup` need not encode an image


class TextImageToVideoLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        media = GivenFrames(components.transformer.config.patch_size)
        parts = FamilyParts("ti2v", TI2VState, WanText(card, components), WanDenoiser(card, components, media=media), VideoLatents(),
                            WAN_DECODER, OptionalFirstFrame(card, components), projection_layout=apply_projection_cache)  # fmt: skip
        super().__init__(card, components, parts, config)
