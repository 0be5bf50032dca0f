"""The probe step kind of TeaCache on a family whose signal is data-dependent (FLUX), and the
request's state: two launches per step, decided in between (fvgraph/caching/tea_cache.py decides on
the host), the second being a residual keep or reuse step (fvgraph/caching/residual_steps.py).

    denoise[_cfg]_tea_probe    the cond branch's embeddings and the first block's modulated input of
                               the stream (`sections.modulated_input`): returns it ("tea_modulated_0")
                               and, small, "tea_change" [B, 2]: mean |m - m_prev| and mean |m_prev|
                               against the one the last probe returned ("tea_previous_0" in; zeros
                               before the first).
    denoise[_cfg]_keep / _reuse  the whole step, its blocks computed (their residual kept) or skipped
                               for the kept residual, as MagCache's and Wan's TeaCache's.

TeaCache4FLUX updates the previous modulated input at every call, computed or not; so does the probe.
The last step always computes, so it runs no probe. With true CFG one decision, read from the cond
branch, serves both branches: the branches' modulated inputs share the image tokens and differ only
by the pooled text inside `temb`, and one decision keeps the step one residual kind, whose two
denoiser calls the CFG fusion pass runs as one. The probe runs `embed` again in the second launch
rather than carrying the embeddings over (cheap next to the blocks, and equal bit for bit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from fvgraph.caching.residual_steps import RESIDUAL_KINDS, kept_names
from fvgraph.caching.sections_step import SectionsStep, relative_change, update_only
from fvgraph.caching.state import Fail, StepCachingState, TensorLayouts, check_tensor
from fvgraph.contract.denoise_update import Sampler
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind

CHANGE = "tea_change"  # the output the loop reads on the host
MODULATED, PREVIOUS = "tea_modulated_0", "tea_previous_0"
PROBE_KINDS = {cfg: f"denoise{'_cfg' if cfg else ''}_tea_probe" for cfg in (False, True)}


def step_kinds(denoise: Mapping[bool, StepKind]) -> dict[str, StepKind]:
    """The probe kinds (the keep / reuse kinds are residual_steps')."""
    kinds = {}
    for cfg, name in PROBE_KINDS.items():
        base = denoise[cfg]
        kinds[name] = base.derived(
            name, drop_inputs=tuple(n for n in base.inputs if update_only(n)), drop_outputs=tuple(base.outputs),
            inputs={PREVIOUS: Role.CARRIED}, outputs={MODULATED: Role.CARRIED, CHANGE: Role.HOST},
            per_inference_step=False, continues=True,
        )  # fmt: skip
    return kinds



def build_steps(sections: DenoiserSections, sampler: Sampler) -> dict[str, nn.Module]:
    return {kind: TeaProbeStep(sections, sampler, cfg) for cfg, kind in PROBE_KINDS.items()}


class TeaProbeStep(SectionsStep):
    """The cond branch's first-block modulated input, and how it changed since the previous one (per row)."""

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        **inputs: torch.Tensor,  # the texts and what else the sections read; tea_previous_0 [B, S, D]
    ) -> dict[str, torch.Tensor]:
        s = self.sections
        self.choose_rows(inputs)
        tokens = s.embed(latents.to(inputs["prompt_embeds"].dtype), timestep, **self.branch_conditions(inputs, 0))
        modulated, previous = s.modulated_input(tokens), inputs[PREVIOUS]
        self.release_rows()
        # TeaCache4FLUX's (m - m_prev).abs().mean() and m_prev.abs().mean(), per request row
        return {MODULATED: modulated, CHANGE: relative_change(modulated, previous)}


@dataclass
class TeaProbeState(StepCachingState):
    """`kept`: each branch's blocks' residual at the last full step; `previous`: the cond branch's
    modulated input at the last probe; between a step's two launches, `compute` (the decision). A
    state saved between the launches resumes with the second."""

    previous: list[torch.Tensor] = field(default_factory=list)
    compute: list[bool] = field(default_factory=list)

    tensor_lists = ("kept", "previous")

    def _probes(self, step_index: int) -> bool:
        """Whether the step runs a probe first: not once it did, nor at the last step (it computes)."""
        return not self.compute and step_index < self.policy.last

    def plan(self, cfg: bool, step_index: int, inputs: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        """The probe, or (once it ran, and at the last step) the whole step, keeping or reusing."""
        if self._probes(step_index):
            probe = {name: t for name, t in inputs.items() if not update_only(name)}
            probe[PREVIOUS] = self.previous[0] if self.previous else self.policy.zero_signal(inputs["latents"])
            return PROBE_KINDS[cfg], probe
        reuse = self.compute == [False]
        if reuse:
            inputs.update(zip(kept_names(cfg), self.kept))
        return RESIDUAL_KINDS[(cfg, reuse)], inputs

    def advance(self, cfg: bool, step_index: int, result: StepResult) -> bool:
        if self._probes(step_index):  # the probe ran: decide whether the blocks run
            # the request's row [1, 2] is the one branch measured
            (compute,), self.memo = self.policy.decide_branches(self.memo, step_index, result[CHANGE], has_kept=bool(self.kept))
            self.previous, self.compute = [result[MODULATED]], [compute]
            return False
        branches = 2 if cfg else 1
        computed = self.compute != [False]
        if computed:
            self.kept = [result[name] for name in kept_names(cfg)]
        self.counted(branches if computed else 0, 0 if computed else branches)
        self.compute = []
        return True

    def check(self, fail: Fail, cfg: bool, phase: str, layouts: TensorLayouts) -> None:
        super().check(fail, cfg, phase, layouts)
        if len(self.previous) not in (0, 1):
            fail("caching.previous", f"must hold 0 or 1 tensors (the cond branch's modulated input), got {len(self.previous)}")
        for i, t in enumerate(self.previous):
            check_tensor(fail, f"caching.previous[{i}]", t, layouts.tokens, layouts.token_dtype)
        if len(self.compute) not in (0, 1) or any(not isinstance(c, bool) for c in self.compute):
            fail("caching.compute", f"must be [] or one decision [true|false], got {self.compute!r}")
        if self.compute and (phase != "denoise" or not self.previous or (self.compute == [False] and not self.kept)):
            fail("caching.compute", "a step between its two launches must be in phase 'denoise' after a probe "
                                    "(caching.previous), and one that reuses needs a kept residual (caching.kept)")  # fmt: skip
