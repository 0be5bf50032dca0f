"""The two denoise step kinds of TaylorSeer (fvgraph/caching/taylor_seer.py), and its per-request
state: a full step that also returns each CFG branch's noise prediction (the features the Taylor
factors are formed from), and a forecast step that runs no denoiser: each branch's noise prediction
is the Taylor series of its kept factors at the request's step distance.

The features are the noise predictions rather than `proj_out`'s output, which diffusers' lite mode
keeps: one is the other reshaped and permuted, and the series is elementwise, so the forecast is the
same numbers. The forecast's coefficients d**k / k! enter as a per-row [B, orders] tensor, never a
Python number, so requests at different distances share one graph; the number of orders (1 ..
max_order + 1) is fixed by the step's inputs, one signature each.

The full step marks its denoiser calls as CFG branches, as the plain step does, so the CFG fusion
pass runs them as one batch at -O1; whether a step keeps or forecasts is fixed when the module is
built, never decided per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fvgraph.caching.sections_step import SectionsForward, SectionsStep
from fvgraph.caching.state import Fail, StepCachingState, TensorLayouts
from fvgraph.contract.denoise_update import Sampler
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind

MAX_ORDERS = 5  # max_order <= 4 (TaylorSeerSettings): at most 5 factors per branch
# The kinds by (cfg, forecast): a full step that keeps each branch's noise prediction, or one that
# forecasts it from the kept Taylor factors.
TAYLOR_KINDS = {(cfg, forecast): f"denoise{'_cfg' if cfg else ''}_taylor_{'predict' if forecast else 'keep'}"
                for cfg in (False, True) for forecast in (False, True)}  # fmt: skip


def step_kinds(denoise: Mapping[bool, StepKind]) -> dict[str, StepKind]:
    kinds = {}
    for (cfg, forecast), name in TAYLOR_KINDS.items():
        branches = 2 if cfg else 1
        if forecast:
            factors = {f"taylor_{b}_{k}": Role.CARRIED for b in range(branches) for k in range(MAX_ORDERS)}
            kinds[name] = denoise[cfg].derived(name, inputs={**factors, "taylor_coeffs": Role.STEP})
        else:
            kinds[name] = denoise[cfg].derived(name, outputs={f"features_{b}": Role.CARRIED for b in range(branches)})
    return kinds


def build_steps(sections: DenoiserSections, sampler: Sampler) -> dict[str, SectionsStep]:
    return {kind: TaylorStep(sections, sampler, cfg, forecast) for (cfg, forecast), kind in TAYLOR_KINDS.items()}


class TaylorStep(SectionsStep):
    """A whole denoise step that keeps (`forecast=False`: outputs "features_0" cond, "features_1"
    uncond) or forecasts (`forecast=True`: inputs "taylor_{branch}_{order}" and "taylor_coeffs")."""

    def __init__(self, sections: DenoiserSections, sampler: Sampler, cfg: bool, forecast: bool):
        super().__init__(sections, sampler, cfg)
        self.denoiser = SectionsForward(sections)  # the same modules: no weight copy
        self.forecast = forecast

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        coeffs: torch.Tensor,  # [B, num_coeffs]
        guidance_scale: torch.Tensor | None = None,  # [B] the CFG scale, when cfg
        taylor_coeffs: torch.Tensor | None = None,  # [B, orders] float32 when forecasting: d**k / k!
        **inputs: torch.Tensor,  # the texts and what else the sections read; carry_0..; when forecasting,
        # taylor_{b}_{k} ([B, C, F, H, W] each)
    ) -> dict[str, torch.Tensor]:
        # 1. each branch's noise prediction: the denoiser, or the Taylor series of its factors
        dtype = inputs["prompt_embeds"].dtype  # the denoiser's compute dtype (its input is cast to it)
        if self.forecast:
            noises = [self._series([inputs[f"taylor_{b}_{k}"] for k in range(taylor_coeffs.shape[1])], taylor_coeffs, dtype)
                      for b in range(len(self.branches))]  # fmt: skip
        else:  # the residual is unused (dead code once traced)
            noises = [noise for noise, _ in self.branch_calls(latents.to(dtype), timestep, inputs)]
        # 2. the guidance combine and the sampler update
        out = self.finish(latents, noises, guidance_scale, inputs, coeffs)
        if not self.forecast:
            out.update({f"features_{b}": n for b, n in enumerate(noises)})
        return out

    @staticmethod
    def _series(factors: list[torch.Tensor], taylor_coeffs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """sum_k F_k * c_k in `dtype`, term by term as diffusers' TaylorSeerState.predict adds them: each
        product in float32 (where a scalar multiply of a low-precision tensor computes) rounded to `dtype`."""
        out = torch.zeros_like(factors[0], dtype=dtype)
        for k, factor in enumerate(factors):
            c = taylor_coeffs[:, k].view(-1, *([1] * (factor.dim() - 1)))
            out = out + (factor.to(dtype).float() * c).to(dtype)
        return out


@dataclass
class TaylorState(StepCachingState):
    """TaylorSeer's: `kept` holds, per CFG branch (cond first), its factors, order 0 first; `memo`
    the step of the last refresh ("last", -1 before the first) and its order count ("orders")."""

    def plan(self, cfg: bool, step_index: int, inputs: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        compute, _ = self.policy.decide(self.memo, step_index, bool(self.kept))
        if not compute:
            inputs.update(self.policy.forecast_inputs(self.kept, self.memo, step_index))
        return TAYLOR_KINDS[(cfg, not compute)], inputs

    def advance(self, cfg: bool, step_index: int, result: StepResult) -> bool:
        memo = self.memo
        compute, self.memo = self.policy.decide(memo, step_index, bool(self.kept))
        branches = 2 if cfg else 1
        if compute:
            self.kept = self.policy.kept_after(self.kept, memo, step_index, result, branches)
        self.counted(branches if compute else 0, 0 if compute else branches)
        return True

    def kept_layout(self, fail: Fail, layouts: TensorLayouts) -> tuple[int, tuple[int, ...], torch.dtype]:
        last, orders, top = self.memo["last"], self.memo["orders"], self.settings.max_order + 1
        if isinstance(last, bool) or not isinstance(last, int) or last < -1:
            fail("caching.memo", f"last={last!r} must be the int step of the last refresh, or -1 before the first")
        if isinstance(orders, bool) or not isinstance(orders, int) or not 0 <= orders <= top:
            fail("caching.memo", f"orders={orders!r} must be an int in [0, max_order + 1 = {top}]")
        # per branch: its factors, shaped like the latents, in the dtype the settings keep them in
        return orders, layouts.latents, getattr(torch, self.settings.taylor_factors_dtype)
