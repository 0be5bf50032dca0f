"""First-Block Cache (FBCache, github.com/chengzeyi/ParaAttention) as a step-caching method: decided from the
step's own data, on the host, between two launches of the step.

At each denoise step FBCache runs the first transformer block and compares its residual r (output
minus input) with the one kept at the branch's last full step:

    change = mean |r - r_kept| / mean |r_kept|

Above `threshold` the remaining blocks run and both residuals are kept; otherwise the remaining
blocks are skipped and the kept residual of the blocks after the first is added to the first
block's output. This is diffusers' `FirstBlockCacheConfig` hook (diffusers.hooks.first_block_cache,
0.42.1), which decides with `.item()` inside the forward. Here the step is two launches
(fvgraph/caching/fb_cache_steps.py): the first returns, beside the first block's output, the two means
per request and branch ("first_block_change", [B, branches, 2]); the runtime copies that output to the
host for the whole group in one transfer (StepKind.host_outputs), and `advance` decides per branch
which second launch runs. The two CFG branches decide apart, as diffusers' "cond" and "uncond" cache
contexts: which branches compute is part of the second launch's kind.

The request's state is a FirstBlockState (fvgraph/caching/fb_cache_steps.py), the `caching` field of
its loop state, saved with it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from fvgraph.caching.fb_cache_steps import FirstBlockState
from fvgraph.caching.settings import CacheSettings, PolicyContext
from fvgraph.contract.denoiser_sections import DenoiserSections


class FirstBlockCacheSettings(CacheSettings):
    """diffusers' `FirstBlockCacheConfig` names."""

    method: Literal["fbcache"] = "fbcache"
    threshold: float = Field(0.05, ge=0, allow_inf_nan=False,
                             description="Relative change of the first block's residual above which the other blocks run.")  # fmt: skip

    state_type: ClassVar[type] = FirstBlockState
    memo_keys: ClassVar[tuple[str, ...]] = ()  # what its policy's start() returns

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> FirstBlockCache:
        return FirstBlockCache(self, None if context is None else context.sections)


class FirstBlockCache:
    """One request's FBCache decisions, per CFG branch from the first-block launch's host row (CHANGE)."""

    def __init__(self, settings: FirstBlockCacheSettings, sections: DenoiserSections | None = None):
        self.threshold = settings.threshold
        self.sections = sections

    def zero_residual(self, latents: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        """The kept first-block residual before the first full step: zeros of the blocks' tokens (an
        edit's image tokens among them)."""
        shape = self.sections.token_shape(latents, condition)
        return torch.zeros(shape, dtype=self.sections.token_dtype, device=latents.device)

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
