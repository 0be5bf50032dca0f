"""What the text-to-image families share (FLUX, Qwen-Image): an image as a one-frame video.

The latents are [1, C, 1, h, w], so the runtime's latents, padding and finite checks are the video
families' own; the schedule is the image pipelines' Euler schedule shifted by the image's token count
(ImageFlowEulerSampler: `ImageLatents`); classifier-free guidance runs as diffusers' `true_cfg_scale`
with a negative prompt (the card's `RecipeSpec.cfg_scale`), and `guidance_scale` is the denoiser's
embedded guidance where its weights take one (`refuse_embedded_guidance`).
"""

from __future__ import annotations

from typing import Any

from fvgraph.adapters.slots import ROW_INPUTS
from fvgraph.card import ModelCard
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.samplers import SamplerPlan
from fvgraph.request import Request, RequestRejected


def image_denoise_kind(name: str, constants: tuple[str, ...]) -> StepKind:
    """An image family's denoise kind: latents, timestep and Euler row per step; `constants` (texts,
    pooled texts or masks, guidance) and, on an engine with adapter slots, each row's slots and scales
    the same at every step of the request."""
    return StepKind(name, component="transformer", phase="denoise", compiled=True, per_inference_step=True,
                    inputs={"latents": Role.STEP, "timestep": Role.STEP, "coeffs": Role.STEP,
                            **dict.fromkeys((*constants, *ROW_INPUTS), Role.CONSTANT)},
                    outputs={"latents": Role.RESULT})  # fmt: skip


class ImageLatents:
    """One-frame latents; the schedule shifted by the image's (2x2-packed) token count."""

    reads: tuple[str, ...] = ()

    def __init__(self, card: ModelCard):
        self.card = card

    def check(self, request: Request) -> None:
        if request.num_frames not in (None, 1):
            raise RequestRejected("num_frames", f"{request.num_frames}: card {self.card.card_id!r} makes images (num_frames=1)")

    def planned(self, sampler: Any, num_steps: int, latent_hw: tuple[int, int], start: int = 0) -> SamplerPlan:
        if start:  # no image loop takes a `strength` (its Request field is refused before this)
            raise ValueError(f"an image schedule starts at its first step, not step {start}")
        h, w = latent_hw
        return sampler.plan(num_steps, (h // 2) * (w // 2))

    def warmup_frames(self, num_frames: int) -> dict[str, Any]:
        return {}


def refuse_embedded_guidance(card: ModelCard, request: Request) -> None:
    """A denoiser whose weights take no guidance input refuses a `guidance_scale` other than the card's."""
    if request.guidance_scale not in (None, card.recipe.default_guidance_scale):
        raise RequestRejected("guidance_scale", f"{request.guidance_scale}: card {card.card_id!r}'s denoiser takes no "
                                                "guidance input (its weights are guidance-free); leave it unset, or use "
                                                "true_cfg_scale with a negative prompt")  # fmt: skip
