"""The loop's side of RL rollouts (fvgraph/behavior.py): a mixin for the text-to-video loop.

A request with `rollout` is sampled by Flow-GRPO's SDE step (FlowSdeSampler) at its noise level: its
denoise steps are the `denoise_sde` kinds, the loop's denoise kinds plus the transition's log-prob as a
host output, built on the same transformer, so rollouts batch with each other like any request. The
mixin picks each state's sampler and plan, keeps the latents before and after every transition and
each log-prob in the state, and builds the request's BehaviorRecord when it ends.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fvgraph.behavior import BehaviorRecord
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.samplers import FlowSdeSampler, SamplerPlan
from fvgraph.loops.steps import DenoiseStep
from fvgraph.request import Request, RequestRejected

DENOISE_SDE, DENOISE_SDE_CFG = "denoise_sde", "denoise_sde_cfg"


def rollout_step_kinds(denoise: Mapping[bool, StepKind]) -> dict[str, StepKind]:
    """The SDE denoise kinds, by CFG: the plain kinds plus "log_prob" [B] read on the host."""
    return {name: denoise[cfg].derived(name, outputs={"log_prob": Role.HOST}) for cfg, name in ((False, DENOISE_SDE), (True, DENOISE_SDE_CFG))}


class LoopRollouts:
    """Reads the loop's card, sampler, components, facts, loop_id, takes_image and `run_facts`."""

    _sde: FlowSdeSampler | None = None

    @property
    def rollout_sampler(self) -> FlowSdeSampler:
        """The SDE sampler on diffusers' flow-matching Euler sigmas at the card's shift (built once)."""
        if self._sde is None:
            self._sde = FlowSdeSampler(float(self.card.recipe.sampler.config.get("flow_shift", 1.0)))
        return self._sde

    def sampler_of(self, state):
        """The sampler a request (or its state) runs: the SDE one for a rollout, else the card's."""
        return self.rollout_sampler if _noise_level(state) is not None else self.sampler

    def planned(self, num_steps: int, state) -> SamplerPlan:
        noise_level = _noise_level(state)
        return self.sampler.plan(num_steps) if noise_level is None else self.rollout_sampler.plan(num_steps, noise_level)

    def _check_rollout(self, resolved: Request) -> None:
        if resolved.rollout is None:
            return
        if self.loop_id != "t2v" or len(self.facts.experts) > 1:
            raise RequestRejected("rollout", f"card {self.card.card_id!r} runs loop {self.loop_id!r}: rollouts run on "
                                             "single-expert text-to-video loops")  # fmt: skip

    def _rollout_steps(self, transformer: nn.Module, tap_points) -> dict[str, nn.Module]:
        sde = self.rollout_sampler
        return {DENOISE_SDE: DenoiseStep(transformer, sde, cfg=False, tap_points=tap_points),
                DENOISE_SDE_CFG: DenoiseStep(transformer, sde, cfg=True, tap_points=tap_points)}  # fmt: skip

    def _record_transition(self, state, result: StepResult) -> None:
        state.record_latents.append(state.latents.detach().clone())  # a graph's output buffer is reused
        state.record_log_probs.append(float(result["log_prob"].reshape(-1)[0]))

    def _behavior_record(self, state) -> BehaviorRecord | None:
        if state.rollout_noise_level is None:
            return None
        embeds = lambda t: None if t is None else t[0].detach().cpu()  # noqa: E731
        return BehaviorRecord(
            request_id=state.request_id, seed=state.seed, noise_level=state.rollout_noise_level,
            guidance_scale=state.guidance_scale, timesteps=state.timesteps.float().cpu(), coeffs=state.coeffs.cpu(),
            latents=torch.cat(state.record_latents).float().cpu(),
            log_probs=torch.tensor(state.record_log_probs, dtype=torch.float32),
            prompt_embeds=embeds(state.prompt_embeds), negative_prompt_embeds=embeds(state.negative_prompt_embeds),
            provenance={**self._provenance(state), **self.run_facts, "attention_backend": self._attention_backend(state)},
        )  # fmt: skip

    def _attention_backend(self, state) -> str:
        """The SDPA backend the denoise steps asked for first at this shape (fvgraph.kernels.attention)."""
        from fvgraph.kernels.attention import sdpa_backends
        from fvgraph.models.wan_sections import wan_attention_shape

        shape = wan_attention_shape(self.components.transformer, {"latents": state.latents, "prompt_embeds": state.prompt_embeds})
        return sdpa_backends(*shape, self.components.device)[0].name


def _noise_level(state) -> float | None:
    """A Request's rollout noise level, or a state's (None: not a rollout)."""
    if isinstance(state, Request):
        return None if state.rollout is None else state.rollout.noise_level
    return state.rollout_noise_level
