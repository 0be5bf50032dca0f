"""The loop's side of RL rollouts (fvgraph/behavior.py), as a part the loop is given at build.

A request with `rollout` is sampled by Flow-GRPO's SDE step (FlowSdeSampler) at its noise level: its
denoise steps are the `denoise_sde` kinds, the loop's denoise kinds plus the transition's log-prob as a
host output, built on the same transformer, so rollouts batch with each other like any request. The
part plans each rollout's schedule, keeps the latents before and after every transition and each
log-prob in the state's one `rollout` field (a RolloutTrace), and builds the request's
BehaviorRecord when it ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fvgraph.behavior import BehaviorRecord
from fvgraph.card import ModelCard
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.rollout_trace import RolloutTrace
from fvgraph.loops.samplers import FlowSdeSampler, SamplerPlan

if TYPE_CHECKING:
    from fvgraph.loops.denoise_state import DenoiseState

DENOISE_SDE, DENOISE_SDE_CFG = "denoise_sde", "denoise_sde_cfg"
SDE_KINDS = {False: DENOISE_SDE, True: DENOISE_SDE_CFG}


def rollout_step_kinds(denoise: Mapping[bool, StepKind]) -> dict[str, StepKind]:
    """The SDE denoise kinds, by CFG: the plain kinds plus "log_prob" [B] read on the host."""
    return {name: denoise[cfg].derived(name, outputs={"log_prob": Role.HOST}) for cfg, name in SDE_KINDS.items()}


class LoopRollouts:
    """The SDE sampler at the card's shift, and what a rollout keeps; its steps are the family's denoise
    steps built on that sampler (`steps`)."""

    def __init__(self, card: ModelCard, run_facts: Mapping[str, Any]):
        config = card.recipe.sampler.config  # the shift of the card's flow schedule: UniPC's `flow_shift`, Euler's `shift`
        self.sampler = FlowSdeSampler(float(config.get("flow_shift", config.get("shift", 1.0))))
        self.run_facts = dict(run_facts)

    def planned(self, num_steps: int, noise_level: float) -> SamplerPlan:
        return self.sampler.plan(num_steps, noise_level)

    @staticmethod
    def steps(sde_steps: Mapping[str, nn.Module], kinds: Mapping[bool, StepKind]) -> dict[str, nn.Module]:
        """The SDE kinds' modules: `sde_steps`, the family's denoise steps (by plain kind name, `kinds` by
        CFG) built on this sampler and the same parity taps as its denoise steps."""
        return {name: sde_steps[kinds[cfg].name] for cfg, name in SDE_KINDS.items()}

    @staticmethod
    def start(noise_level: float, latents: torch.Tensor) -> RolloutTrace:
        return RolloutTrace(noise_level, [latents.clone()])

    @staticmethod
    def record(state: DenoiseState, result: StepResult) -> None:
        state.rollout.latents.append(state.latents.detach().clone())  # a graph's output buffer is reused
        state.rollout.log_probs.append(float(result["log_prob"].reshape(-1)[0]))

    def behavior_record(self, state: DenoiseState, provenance: dict, attention_backend: str) -> BehaviorRecord:
        trace = state.rollout
        embeds = lambda t: None if t is None else t[0].detach().cpu()  # noqa: E731
        return BehaviorRecord(
            request_id=state.request_id, seed=state.seed, noise_level=trace.noise_level,
            guidance_scale=state.guidance_scale, timesteps=state.timesteps.float().cpu(), coeffs=state.coeffs.cpu(),
            latents=torch.cat(trace.latents).float().cpu(), log_probs=torch.tensor(trace.log_probs, dtype=torch.float32),
            prompt_embeds=embeds(state.prompt_embeds), negative_prompt_embeds=embeds(state.negative_prompt_embeds),
            provenance={**provenance, **self.run_facts, "attention_backend": attention_backend},
        )  # fmt: skip
