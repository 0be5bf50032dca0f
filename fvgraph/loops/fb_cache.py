"""First-Block Cache (FBCache, github.com/chengzeyi/ParaAttention) as an interceptor: decided from the
step's own data, on the host, between two launches of the step.

At each denoise step FBCache runs the first transformer block and compares its residual r (output
minus input) with the one kept at the branch's last full step:

    change = mean |r - r_kept| / mean |r_kept|

Above `threshold` the remaining blocks run and both residuals are kept; otherwise the remaining
blocks are skipped and the kept residual of the blocks after the first is added to the first
block's output. This is diffusers' `FirstBlockCacheConfig` hook (diffusers.hooks.first_block_cache,
0.42.1), which decides with `.item()` inside the forward. Here the step is two launches
(fvgraph/loops/fb_cache_steps.py): the first returns, beside the first block's output, the two means
per request and branch ("first_block_change", [B, branches, 2]); the runtime copies that output to the
host for the whole group in one transfer (StepKind.host_outputs), and `advance` decides per branch
which second launch runs. The two CFG branches decide apart, as diffusers' "cond" and "uncond" cache
contexts: which branches compute is part of the second launch's kind.

The state lives in T2VState and is saved with it: `cache_kept` (per branch, the residual of the blocks
after the first), `cache_first` (per branch, the first block's residual at that branch's last full
step) and, between the two launches of a step, `cache_head` (per branch, the first block's output)
and `cache_compute` (the decisions). A state saved between the launches resumes with the second.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from diffusers.hooks import FirstBlockCacheConfig
from pydantic import Field

from fvgraph.loops.fb_cache_steps import AFTER_FIRST_KINDS, CHANGE, FIRST_BLOCK_KINDS, first_block_shape
from fvgraph.loops.interceptor import CacheSettings, PolicyContext
from fvgraph.loops.loop import StepResult, WorkPlan

T2VState = Any  # fvgraph.loops.t2v_loop.T2VState, which imports this module

FIRST_BLOCK_INPUTS = ("latents", "timestep", "prompt_embeds", "negative_prompt_embeds")


class FirstBlockCacheSettings(CacheSettings):
    """diffusers' `FirstBlockCacheConfig` names."""

    method: Literal["fbcache"] = "fbcache"
    threshold: float = Field(0.05, ge=0, allow_inf_nan=False,
                             description="Relative change of the first block's residual above which the other blocks run.")  # fmt: skip

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> FirstBlockCache:
        return FirstBlockCache(self)

    def diffusers_config(self, num_inference_steps: int) -> FirstBlockCacheConfig:
        return FirstBlockCacheConfig(threshold=self.threshold)


class FirstBlockCache:
    """One request's FBCache decisions. `measures` tells the loop to run the first-block launch first
    and pass its host row to `decide_branches` (interceptor.MeasuringInterceptor)."""

    measures = CHANGE

    def __init__(self, settings: FirstBlockCacheSettings):
        self.threshold = settings.threshold

    def start(self) -> dict[str, float]:
        return {}  # the state is the kept tensors

    def decide_branches(self, memo: dict[str, float], step_index: int, change: torch.Tensor,
                        has_kept: bool) -> tuple[tuple[bool, ...], dict[str, float]]:  # fmt: skip
        """Per CFG branch, whether the blocks after the first run. `change` is [branches, 2] on the host
        (mean |r - r_kept|, mean |r_kept|), divided here in its own dtype as diffusers divides on the
        device; nothing kept yet (the first step) computes, as diffusers does."""
        if not has_kept:
            return (True,) * change.shape[0], memo
        ratios = (change[:, 0] / change[:, 1]).tolist()
        return tuple(ratio > self.threshold for ratio in ratios), memo


def first_block_plan(state: T2VState, inputs: dict[str, torch.Tensor], transformer) -> tuple[str, dict[str, torch.Tensor]]:
    """The kind and inputs of the request's next launch: the first block, or (once it ran) the rest."""
    if not state.cache_head:
        kept = state.cache_first
        if not kept:  # before the first full step: zeros in the tokens' dtype (the patch embedding's, which
            # `transformer.dtype` may not be when the model keeps its first parameter in fp32)
            kept = [torch.zeros(first_block_shape(transformer, state.latents), dtype=transformer.patch_embedding.weight.dtype,
                                device=state.latents.device)] * (2 if state.cfg else 1)  # fmt: skip
        first_inputs = {name: inputs[name] for name in FIRST_BLOCK_INPUTS if name in inputs}
        first_inputs.update({f"first_kept_{b}": t for b, t in enumerate(kept)})
        return FIRST_BLOCK_KINDS[state.cfg], first_inputs
    inputs.update({f"first_{b}": t for b, t in enumerate(state.cache_head)})
    inputs.update({f"kept_{b}": state.cache_kept[b] for b, compute in enumerate(state.cache_compute) if not compute})
    return AFTER_FIRST_KINDS[(state.cfg, tuple(state.cache_compute))], inputs


def advance_first_block(policy: FirstBlockCache, state: T2VState, result: StepResult) -> bool:
    """Fold one launch's outputs into the state; True once the step is whole (its second launch ran)."""
    branches = 2 if state.cfg else 1
    if not state.cache_head:  # the first block ran: decide which branches compute the rest
        state.cache_head = [result[f"first_{b}"] for b in range(branches)]
        compute, state.cache_memo = policy.decide_branches(state.cache_memo, state.step_index, result[CHANGE][0],
                                                           has_kept=bool(state.cache_first))  # fmt: skip
        state.cache_compute = list(compute)
        return False
    kept, first = list(state.cache_kept) or [None] * branches, list(state.cache_first) or [None] * branches
    for b, compute in enumerate(state.cache_compute):
        if compute:
            kept[b], first[b] = result[f"kept_{b}"], result[f"first_kept_{b}"]
    state.cache_kept, state.cache_first = kept, first
    computed = sum(state.cache_compute)
    state.cache_counts["computed"] = state.cache_counts.get("computed", 0) + computed
    state.cache_counts["reused"] = state.cache_counts.get("reused", 0) + branches - computed
    state.cache_head, state.cache_compute = [], []
    return True


def after_first_variants(plan: WorkPlan) -> list[WorkPlan]:
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
        variants.append(WorkPlan(plan.request_id, kind, {**base, **kept}, plan.step_index, plan.pixel_shape, plan.constants))
    return variants
