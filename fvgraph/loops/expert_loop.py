"""Two-expert loops of Wan 2.2 A14B: `transformer` denoises the high-noise steps, `transformer_2` the rest.

As diffusers' WanPipeline / WanImageToVideoPipeline with `transformer_2` and `boundary_ratio`: a step
whose timestep is >= boundary_ratio x the training timesteps runs the first expert with
`guidance_scale`, every later step the second with `guidance_scale_2` (whether both CFG branches run
is decided by `guidance_scale`, as there). Each expert's step is a step kind of its own, so it has
its own signature and graphs, and requests in different stages batch with their own expert. The
request switches expert once, at the first step below the boundary; its sampler history carries on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.models.components import Components
from fvgraph.loops.i2v_loop import STEP_KINDS as I2V_STEP_KINDS
from fvgraph.loops.i2v_loop import I2VState, ImageToVideoLoop
from fvgraph.contract.plan import WorkPlan
from fvgraph.request import Request
from fvgraph.loops.steps import DenoiseStep
from fvgraph.loops.t2v_loop import DENOISE, DENOISE_CFG, DenoiseFacts, T2VState, TextToVideoLoop, denoise_kind
from fvgraph.loops.t2v_loop import STEP_KINDS as T2V_STEP_KINDS
from fvgraph.loops.taps import TapPoints

DENOISE_2, DENOISE_CFG_2 = "denoise_2", "denoise_cfg_2"  # the low-noise expert's kinds
SECOND_EXPERT_KINDS = {
    DENOISE_2: denoise_kind(DENOISE_2, cfg=False, component="transformer_2"),
    DENOISE_CFG_2: denoise_kind(DENOISE_CFG_2, cfg=True, component="transformer_2"),
}
LOW_NOISE_KIND = {DENOISE: DENOISE_2, DENOISE_CFG: DENOISE_CFG_2}


class TwoExperts:
    """What a loop becomes with two experts (mixed in before TextToVideoLoop or ImageToVideoLoop)."""

    def __init__(self, card: ModelCard, components: Components):
        super().__init__(card, components)
        if components.transformer_2 is None or card.recipe.boundary_ratio is None:
            raise ValueError(
                f"card {card.card_id!r}: loop {self.loop_id!r} needs transformer_2 in the weights and "
                f"recipe.boundary_ratio; found experts {self.facts.experts}, boundary_ratio={card.recipe.boundary_ratio}"
            )
        train_steps = card.recipe.sampler.config.get("num_train_timesteps", 1000)
        self.boundary_timestep = card.recipe.boundary_ratio * train_steps

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]:
        steps = super().build_steps(taps)
        c = self.components
        tap_points = TapPoints(c.transformer_2) if taps else None
        second = {
            DENOISE_2: DenoiseStep(c.transformer_2, self.sampler, cfg=False, tap_points=tap_points),
            DENOISE_CFG_2: DenoiseStep(c.transformer_2, self.sampler, cfg=True, tap_points=tap_points),
        }
        return {**steps, **{kind: step.to(c.device).eval() for kind, step in second.items()}}

    def _conditioning(self, request: Request, latents: torch.Tensor) -> dict:
        fields = super()._conditioning(request, latents)
        second = request.guidance_scale_2
        if second is None:
            second = self.card.recipe.default_guidance_scale_2
        fields["guidance_scale_2"] = float(request.guidance_scale if second is None else second)
        return fields

    def _low_noise(self, state: T2VState) -> bool:
        return bool(state.timesteps[state.step_index] < self.boundary_timestep)

    def next(self, state: T2VState) -> WorkPlan | object:
        if state.phase == "denoise" and state.derived is not None and self._low_noise(state) \
                and state.derived.kind not in SECOND_EXPERT_KINDS:  # fmt: skip
            state.derived = None  # crossing the boundary: the low-noise expert's facts from here on
        return super().next(state)

    def _denoise_facts(self, state: T2VState) -> DenoiseFacts:
        facts = super()._denoise_facts(state)
        if not self._low_noise(state):
            return facts
        constants = dict(facts.constants)
        if "guidance_scale" in constants:
            constants["guidance_scale"] = torch.full_like(constants["guidance_scale"], state.guidance_scale_2)
        return facts._replace(kind=LOW_NOISE_KIND[facts.kind], constants=constants)


@dataclass
class TwoExpertT2VState(T2VState):
    guidance_scale_2: float = 0.0  # the low-noise expert's guidance (resolved at init)


@dataclass
class TwoExpertI2VState(I2VState):
    guidance_scale_2: float = 0.0


class TwoExpertTextToVideoLoop(TwoExperts, TextToVideoLoop):
    loop_id = "t2v_two_expert"
    state_type = TwoExpertT2VState
    step_kinds = {**T2V_STEP_KINDS, **SECOND_EXPERT_KINDS}


class TwoExpertImageToVideoLoop(TwoExperts, ImageToVideoLoop):
    loop_id = "i2v_two_expert"
    state_type = TwoExpertI2VState
    step_kinds = {**I2V_STEP_KINDS, **SECOND_EXPERT_KINDS}
