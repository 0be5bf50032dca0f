"""The step kinds of a First-Block Cache (FBCache) denoise step, and its per-request state: two
launches per step, decided in between (fvgraph/caching/fb_cache.py decides on the host).

    denoise[_cfg]_first_block      per CFG branch: embeddings and the first block. Returns the first
                                   block's output ("first_0", "first_1") and, small, "first_block_change"
                                   [B, branches, 2]: the mean |residual - kept residual| and the mean
                                   |kept residual| of the first block's residual against the one kept
                                   at the branch's last full step ("first_kept_b" in).
    denoise[_cfg]_after_first_<d>  per branch the remaining blocks (d = "c": compute, and keep their
                                   residual "kept_b" and the first block's "first_kept_b") or the kept
                                   residual added instead ("r": reuse), then the output section, the
                                   guidance combine and the sampler update. <d> has one letter per
                                   branch, cond first: the two branches decide apart, as diffusers
                                   keeps a "cond" and an "uncond" cache context.

The residuals are diffusers' (diffusers.hooks.first_block_cache, 0.42.1), taken on the sections'
stream (the blocks' `hidden_states`; FLUX's image tokens): the first block's is its output minus its
input; the kept one is the last block's output minus the first block's output, and on reuse the
blocks' output is the first block's output plus it. "first_b" is the first block's whole output
(FLUX's text stream too), which the remaining blocks go on from. The second launch runs `embed`
again (cheap next to the blocks, and equal bit for bit) rather than carrying the embeddings over.
Every step is a pure tensor function, fixed at construction (which branches compute is the kind).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from fvgraph.caching.sections_step import SectionsStep, relative_change, update_only
from fvgraph.caching.state import Fail, StepCachingState, TensorLayouts, check_tensor
from fvgraph.contract.denoise_update import Sampler
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind

CHANGE = "first_block_change"  # the output the loop reads on the host
# The first-block kind by cfg, and the after-first kind by (cfg, which branches compute).
FIRST_BLOCK_KINDS = {cfg: f"denoise{'_cfg' if cfg else ''}_first_block" for cfg in (False, True)}
AFTER_FIRST_KINDS = {
    (cfg, compute): f"denoise{'_cfg' if cfg else ''}_after_first_{''.join('c' if c else 'r' for c in compute)}"
    for cfg in (False, True) for compute in itertools.product((True, False), repeat=2 if cfg else 1)
}  # fmt: skip


def step_kinds(denoise: Mapping[bool, StepKind]) -> dict[str, StepKind]:
    kinds = {}
    for cfg, name in FIRST_BLOCK_KINDS.items():
        branches = range(2 if cfg else 1)
        base = denoise[cfg]
        kinds[name] = base.derived(
            name, drop_inputs=tuple(n for n in base.inputs if update_only(n)), drop_outputs=tuple(base.outputs),
            inputs={f"first_kept_{b}": Role.CARRIED for b in branches},
            outputs={**{f"first_{b}": Role.CARRIED for b in branches}, CHANGE: Role.HOST},
            per_inference_step=False, continues=True,
        )  # fmt: skip
    for (cfg, compute), name in AFTER_FIRST_KINDS.items():
        carried = {f"first_{b}": Role.CARRIED for b in range(len(compute))}
        kept_in = {f"kept_{b}": Role.CARRIED for b, c in enumerate(compute) if not c}
        kept_out = {f"{prefix}{b}": Role.CARRIED for b, c in enumerate(compute) if c for prefix in ("kept_", "first_kept_")}
        kinds[name] = denoise[cfg].derived(name, inputs={**carried, **kept_in}, outputs=kept_out)
    return kinds



def build_steps(sections: DenoiserSections, sampler: Sampler) -> dict[str, nn.Module]:
    steps: dict[str, nn.Module] = {kind: FirstBlockStep(sections, sampler, cfg) for cfg, kind in FIRST_BLOCK_KINDS.items()}
    steps.update({kind: AfterFirstBlockStep(sections, sampler, cfg, compute) for (cfg, compute), kind in AFTER_FIRST_KINDS.items()})
    return steps


class FirstBlockStep(SectionsStep):
    """Per CFG branch the first block, and how its residual on the stream changed since the kept one (per row)."""

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        **inputs: torch.Tensor,  # the texts and what else the sections read; first_kept_0 (, first_kept_1):
        # [B, S, D], zeros before the first full step
    ) -> dict[str, torch.Tensor]:
        model_input = latents.to(inputs["prompt_embeds"].dtype)
        s = self.sections
        out, changes = {}, []
        self.choose_rows(inputs)
        for b, _ in enumerate(self.branches):
            tokens = s.embed(model_input, timestep, **self.branch_conditions(inputs, b))
            first = s.first_block(tokens.hidden_states, tokens)
            residual, previous = s.stream(first, tokens) - s.stream(tokens.hidden_states, tokens), inputs[f"first_kept_{b}"]
            # diffusers' (residual - previous).abs().mean() and previous.abs().mean(), per request row
            changes.append(relative_change(residual, previous))
            out[f"first_{b}"] = first
        self.release_rows()
        out[CHANGE] = torch.stack(changes, dim=1)  # [B, branches, 2]
        return out


class AfterFirstBlockStep(SectionsStep):
    """The rest of an FBCache step; `compute[b]`: branch b runs the remaining blocks, else reuses."""

    def __init__(self, sections: DenoiserSections, sampler: Sampler, cfg: bool, compute: tuple[bool, ...]):
        super().__init__(sections, sampler, cfg)
        if len(compute) != len(self.branches):
            raise ValueError(f"compute={compute} must hold one decision per CFG branch ({len(self.branches)})")
        self.compute = compute

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        coeffs: torch.Tensor,  # [B, num_coeffs]
        guidance_scale: torch.Tensor | None = None,  # [B] the CFG scale, when cfg
        **inputs: torch.Tensor,  # the texts, ...; carry_0..; first_b (the first block's output); kept_b for a reused branch
    ) -> dict[str, torch.Tensor]:
        # 1. each branch: the remaining blocks (their residual kept) or the kept residual, then the output
        model_input = latents.to(inputs["prompt_embeds"].dtype)
        s = self.sections
        out, noises = {}, []
        self.choose_rows(inputs)
        for b, compute in enumerate(self.compute):
            tokens = s.embed(model_input, timestep, **self.branch_conditions(inputs, b))
            first = inputs[f"first_{b}"]
            head = s.stream(first, tokens)
            if compute:
                leaving = s.stream(s.remaining_blocks(first, tokens), tokens)
                out[f"kept_{b}"] = leaving - head
                out[f"first_kept_{b}"] = head - s.stream(tokens.hidden_states, tokens)
            else:
                leaving = inputs[f"kept_{b}"] + head  # diffusers' FBCHeadBlockHook: tail residual + head output
            noises.append(s.project_out(leaving, tokens))
        self.release_rows()
        # 2. the guidance combine and the sampler update
        out.update(self.finish(latents, noises, guidance_scale, inputs, coeffs))
        return out


@dataclass
class FirstBlockState(StepCachingState):
    """FBCache's: per CFG branch `kept` (the residual of the blocks after the first) and `first` (the
    first block's residual) at the branch's last full step; between a step's two launches, `head`
    (per branch, the first block's output) and `compute` (the decisions). A state saved between the
    launches resumes with the second."""

    first: list[torch.Tensor] = field(default_factory=list)
    head: list[torch.Tensor] = field(default_factory=list)
    compute: list[bool] = field(default_factory=list)

    tensor_lists = ("kept", "first", "head")

    def plan(self, cfg: bool, step_index: int, inputs: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        """The first block, or (once it ran) the rest."""
        if not self.head:
            first_kept = self.first or [self.policy.zero_residual(inputs["latents"], inputs.get("condition"))] * (2 if cfg else 1)
            first_inputs = {name: t for name, t in inputs.items() if not update_only(name)}
            first_inputs.update({f"first_kept_{b}": t for b, t in enumerate(first_kept)})
            return FIRST_BLOCK_KINDS[cfg], first_inputs
        inputs.update({f"first_{b}": t for b, t in enumerate(self.head)})
        inputs.update({f"kept_{b}": self.kept[b] for b, compute in enumerate(self.compute) if not compute})
        return AFTER_FIRST_KINDS[(cfg, tuple(self.compute))], inputs

    def advance(self, cfg: bool, step_index: int, result: StepResult) -> bool:
        branches = 2 if cfg else 1
        if not self.head:  # the first block ran: decide which branches compute the rest
            self.head = [result[f"first_{b}"] for b in range(branches)]
            compute, self.memo = self.policy.decide_branches(self.memo, step_index, result[CHANGE][0], has_kept=bool(self.first))
            self.compute = list(compute)
            return False
        kept, first = list(self.kept) or [None] * branches, list(self.first) or [None] * branches
        for b, compute in enumerate(self.compute):
            if compute:
                kept[b], first[b] = result[f"kept_{b}"], result[f"first_kept_{b}"]
        self.kept, self.first = kept, first
        computed = sum(self.compute)
        self.counted(computed, branches - computed)
        self.head, self.compute = [], []
        return True

    def check(self, fail: Fail, cfg: bool, phase: str, layouts: TensorLayouts) -> None:
        super().check(fail, cfg, phase, layouts)
        branches = 2 if cfg else 1
        for name, shape in (("first", layouts.tokens), ("head", layouts.blocks)):
            values = getattr(self, name)
            if len(values) not in (0, branches):
                fail(f"caching.{name}", f"must hold 0 or {branches} tensors (one per CFG branch), got {len(values)}")
            for i, t in enumerate(values):
                check_tensor(fail, f"caching.{name}[{i}]", t, shape, layouts.token_dtype)
        if len(self.compute) != len(self.head):
            fail("caching.compute", f"must hold one decision per tensor of caching.head ({len(self.head)}), got {len(self.compute)}")
        if self.head and (phase != "denoise" or any(not c and not self.kept for c in self.compute)):
            fail("caching.head", "a step between its two launches must be in phase 'denoise', and a branch that "
                                 "reuses needs a kept residual (caching.kept)")  # fmt: skip


def warmup_variants(plan: WorkPlan) -> list[WorkPlan]:
    """For warmup: the plans of every other compute / reuse pattern of `plan`'s second launch, with
    zeros for the kept residuals a pattern reads that `plan` does not (shaped as the first block's
    output, as kept residuals are). [] for any other kind."""
    mine = next((key for key, kind in AFTER_FIRST_KINDS.items() if kind == plan.kind), None)
    if mine is None:
        return []
    base = {name: t for name, t in plan.inputs.items() if not name.startswith("kept_")}
    variants = []
    for (cfg, compute), kind in AFTER_FIRST_KINDS.items():
        if cfg != mine[0] or kind == plan.kind:
            continue
        kept = {f"kept_{b}": plan.inputs.get(f"kept_{b}", torch.zeros_like(plan.inputs[f"first_{b}"]))
                for b, c in enumerate(compute) if not c}  # fmt: skip
        variants.append(WorkPlan(plan.request_id, kind, {**base, **kept}, plan.step_index, plan.pixel_shape,
                                 adapter_places=plan.adapter_places))
    return variants
