"""The two denoise step kinds of the residual-reuse methods (MagCache, TeaCache): a full step that
keeps the blocks' residual, and a reuse step that skips the blocks and adds the kept residual instead.

The residual is the blocks' output minus the first block's input (tokens [B, S, D]), as diffusers'
MagCache hooks keep it; on reuse the block stack's output is that input plus the kept residual, as
those hooks return it. The denoiser runs through its family's sections (SectionsForward), so a full
step equals the plain denoise step bit for bit in eager.

Each branch calls the `denoiser` submodule between CFG-branch markers, its inputs (the kept residual
too) and both of its outputs marked, so at -O1 and up the CFG fusion pass runs the two calls as one
at twice the batch, as it does for the plain denoise step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fvgraph.caching.sections_step import SectionsForward, SectionsStep
from fvgraph.caching.state import StepCachingState
from fvgraph.contract.denoise_update import Sampler
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind

# The kinds by (cfg, reuse): a full step that keeps the blocks' residual, or one that reuses it.
RESIDUAL_KINDS = {(cfg, reuse): f"denoise{'_cfg' if cfg else ''}_{'reuse' if reuse else 'keep'}"
                  for cfg in (False, True) for reuse in (False, True)}  # fmt: skip


def kept_names(cfg: bool) -> tuple[str, ...]:
    """Per CFG branch (cond first), the kept residual's input and output name."""
    return ("kept_0", "kept_1") if cfg else ("kept_0",)


def step_kinds(denoise: Mapping[bool, StepKind]) -> dict[str, StepKind]:
    """The kinds, derived from the loop's denoise kind by CFG: keep returns the residuals, reuse takes them."""
    kinds = {}
    for (cfg, reuse), name in RESIDUAL_KINDS.items():
        kept = dict.fromkeys(kept_names(cfg), Role.CARRIED)
        kinds[name] = denoise[cfg].derived(name, inputs=kept if reuse else None, outputs=None if reuse else kept)
    return kinds


def build_steps(sections: DenoiserSections, sampler: Sampler) -> dict[str, SectionsStep]:
    return {kind: ResidualStep(sections, sampler, cfg, reuse) for (cfg, reuse), kind in RESIDUAL_KINDS.items()}


class ResidualStep(SectionsStep):
    """A whole denoise step that keeps (`reuse=False`) or reuses (`reuse=True`) the blocks' residual
    of each CFG branch: input/output "kept_0" (cond) and "kept_1" (uncond, when `cfg`)."""

    def __init__(self, sections: DenoiserSections, sampler: Sampler, cfg: bool, reuse: bool):
        super().__init__(sections, sampler, cfg)
        self.denoiser = SectionsForward(sections)  # the same modules: no weight copy
        self.reuse = reuse

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        coeffs: torch.Tensor,  # [B, num_coeffs]
        guidance_scale: torch.Tensor | None = None,  # [B] the CFG scale, when cfg
        **inputs: torch.Tensor,  # the texts and what else the sections read; carry_0..; on reuse kept_0.. ([B, S, D])
    ) -> dict[str, torch.Tensor]:
        # 1. each branch: blocks computed (residual kept) or skipped (residual reused)
        model_input = latents.to(inputs["prompt_embeds"].dtype)
        kept = [inputs[f"kept_{b}"] for b in range(len(self.branches))] if self.reuse else None
        noises, residuals = (list(each) for each in zip(*self.branch_calls(model_input, timestep, inputs, kept)))
        # 2. the guidance combine and the sampler update
        out = self.finish(latents, noises, guidance_scale, inputs, coeffs)
        if not self.reuse:
            out.update({f"kept_{b}": r for b, r in enumerate(residuals)})
        return out


@dataclass
class ResidualState(StepCachingState):
    """MagCache's and TeaCache's: `kept` holds each branch's blocks' residual at the last full step,
    and the policy decides keep or reuse for the whole step (both branches see the same steps)."""

    def plan(self, cfg: bool, step_index: int, inputs: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        compute, _ = self.policy.decide(self.memo, step_index, bool(self.kept))
        if not compute:
            inputs.update(zip(kept_names(cfg), self.kept))
        return RESIDUAL_KINDS[(cfg, not compute)], inputs

    def advance(self, cfg: bool, step_index: int, result: StepResult) -> bool:
        compute, self.memo = self.policy.decide(self.memo, step_index, bool(self.kept))
        branches = 2 if cfg else 1
        if compute:
            self.kept = [result[name] for name in kept_names(cfg)]
        self.counted(branches if compute else 0, 0 if compute else branches)
        return True
