"""What the text-to-image loops share (FLUX, Qwen-Image): an image as a one-frame video.

The latents are [1, C, 1, h, w], so the runtime's latents, padding and finite checks are the video
loops' own; the schedule is the image pipelines' Euler schedule shifted by the image's token count
(ImageFlowEulerSampler); classifier-free guidance runs as diffusers' `true_cfg_scale` with a
negative prompt. A loop with denoiser sections serves step caching (FLUX); LoRA adapters run as in
the video loops (each denoise step takes the request's slot rows); rollouts are not wired for these
loops: a request for one is refused naming the field.
"""

from __future__ import annotations

from fvgraph.adapters.slots import ROW_INPUTS
from fvgraph.card import ModelCard
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.samplers import SamplerPlan
from fvgraph.loops.t2v_loop import T2VState, TextToVideoLoop
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected


def image_denoise_kind(name: str, constants: tuple[str, ...]) -> StepKind:
    """An image loop's denoise kind: latents, timestep and Euler row per step; `constants` (texts,
    pooled texts or masks, guidance) and, on an engine with adapter slots, each row's slots and scales
    the same at every step of the request."""
    return StepKind(name, component="transformer", phase="denoise", compiled=True, per_inference_step=True,
                    inputs={"latents": Role.STEP, "timestep": Role.STEP, "coeffs": Role.STEP,
                            **dict.fromkeys((*constants, *ROW_INPUTS), Role.CONSTANT)},
                    outputs={"latents": Role.RESULT})  # fmt: skip


class ImageLoop(TextToVideoLoop):
    caches = False  # a family without denoiser sections: requests with `cache` are refused

    def __init__(self, card: ModelCard, components: Components):
        super().__init__(card, components)
        self.sections = None
        self.guidance_embeds = bool(components.transformer.config.get("guidance_embeds", False))

    def check_request(self, request: Request) -> Request:
        if request.rollout is not None:
            raise RequestRejected("rollout", f"card {self.card.card_id!r} runs loop {self.loop_id!r}, which has no rollout yet")
        if not self.guidance_embeds and request.guidance_scale not in (None, self.card.recipe.default_guidance_scale):
            raise RequestRejected("guidance_scale", f"{request.guidance_scale}: card {self.card.card_id!r}'s denoiser takes no "
                                                    "guidance input (its weights are guidance-free); leave it unset, or use "
                                                    "true_cfg_scale with a negative prompt")  # fmt: skip
        if request.num_frames not in (None, 1):
            raise RequestRejected("num_frames", f"{request.num_frames}: card {self.card.card_id!r} makes images (num_frames=1)")
        return super().check_request(request)

    def _check_caching(self, resolved: Request) -> Request:
        if resolved.caching is not None and not self.caches:
            raise RequestRejected("cache", f"card {self.card.card_id!r} runs loop {self.loop_id!r}, which has no step caching yet")
        return super()._check_caching(resolved)

    def planned(self, num_steps: int, state) -> SamplerPlan:
        """The schedule shifted by the image's token count (from a request's size or a state's latents)."""
        if isinstance(state, Request):
            h, w = state.height // self.spatial_scale, state.width // self.spatial_scale
        else:
            h, w = state.latents.shape[-2:]
        return self.sampler.plan(num_steps, (h // 2) * (w // 2))

    def init(self, request: Request) -> T2VState:
        state = super().init(request)
        state.guidance_scale = float(request.true_cfg_scale)  # the CFG combine's scale
        return state
