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

import torch
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.models.components import Components
from fvgraph.loops.i2v_loop import STEP_KINDS as I2V_STEP_KINDS
from fvgraph.loops.i2v_loop import VAE_ENCODE, I2VState, ImageToVideoLoop
from fvgraph.loops.i2v_steps import FirstFrameEncodeStep
from fvgraph.contract.plan import StepResult
from fvgraph.request import Request

STEP_KINDS = {kind: spec for kind, spec in I2V_STEP_KINDS.items() if spec.component != "image_encoder"}


@dataclass
class TI2VState(I2VState):
    """I2VState where `condition` holds the given first frame's latents [1, C, 1, h, w] (zeros for a
    text-only request) and `frame_mask` [1, 1, f, h, w] is 0 on given latent frames, 1 elsewhere."""

    frame_mask: torch.Tensor | None = None


class TextImageToVideoLoop(ImageToVideoLoop):
    loop_id = "ti2v"
    state_type = TI2VState
    step_kinds = STEP_KINDS
    device_fields = (*ImageToVideoLoop.device_fields, "frame_mask")
    image_required = False
    pre_denoise_phases = (VAE_ENCODE,)

    def __init__(self, card: ModelCard, components: Components):
        super().__init__(card, components)
        if self.facts.denoiser_in_channels != self.latent_channels:
            raise ValueError(
                f"card {card.card_id!r}: loop 'ti2v' gives the first frame as latents, so the denoiser must take "
                f"exactly the VAE's {self.latent_channels} latent channels; its weights take {self.facts.denoiser_in_channels}"
            )
        if self.facts.image_dim is not None:
            raise ValueError(f"card {card.card_id!r}: loop 'ti2v' has no image encoder, but the denoiser takes "
                             f"image embeddings (image_dim={self.facts.image_dim})")  # fmt: skip

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]:
        steps = super().build_steps(taps)
        c = self.components
        steps[VAE_ENCODE] = FirstFrameEncodeStep(c.vae).to(c.device).eval()
        return steps

    def _warmup_inputs(self, height: int, width: int) -> dict:
        return {}  # a text-only request runs the same denoise step; `fvgraph warmup` need not encode an image

    def _conditioning(self, request: Request, latents: torch.Tensor) -> dict:
        """The frame mask, and for a text-only request the (zero) given frame; an image request's
        given frame comes from the vae_encode step."""
        _, channels, frames, h, w = latents.shape
        device = self.components.device
        mask = torch.ones(1, 1, frames, h, w, device=device)
        if request.image is None:
            return {"frame_mask": mask, "condition": torch.zeros(1, channels, 1, h, w, device=device)}
        mask[:, :, 0] = 0
        return {**super()._conditioning(request, latents), "frame_mask": mask}

    def advance(self, state: TI2VState, result: StepResult) -> TI2VState:
        state = super().advance(state, result)
        if state.step_index == state.num_steps and state.frame_mask is not None:
            # after the last step: the given frame back in place of the denoised one (as the pipeline does)
            state.latents = (1 - state.frame_mask) * state.condition + state.frame_mask * state.latents
            state.frame_mask = state.condition = None
        return state

    def _conditioning_inputs(self, state: TI2VState) -> dict[str, torch.Tensor]:
        return {"first_frame": state.condition, "frame_mask": state.frame_mask}

    def adopt(self, state: TI2VState) -> TI2VState:
        """As the t2v loop's, plus the first-frame fields: until the last denoise step ran, a mask of
        the latents' frames holding only 0 and 1, and a given frame of the latents' channels and size."""
        state = super().adopt(state)
        if state.phase in ("decode", "done") and state.frame_mask is None and state.condition is None:
            return state
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
        return state
