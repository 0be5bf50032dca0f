"""TaylorSeer (Liu et al., arXiv 2503.06923) as a step-caching method: a fixed refresh schedule, and the
denoiser's output forecast from a Taylor series between refreshes.

What diffusers' hook (diffusers.hooks.taylorseer_cache, 0.42.1) does on WanTransformer3DModel:
its default module patterns (`^blocks.*attn`, matched whole) name no Wan module (Wan's are `attn1`
and `attn2`), so the default config hooks nothing there. Its lite mode (`use_lite_mode=True`) caches
`proj_out`'s output and turns the blocks into no-ops on forecast steps; that is what runs here. The
output of `proj_out` becomes the noise prediction by a reshape and a permutation, so its Taylor
series is the noise prediction's, elementwise: the features kept are each CFG branch's noise
prediction, and a forecast step runs no transformer at all (fvgraph/caching/taylor_steps.py).

The hook's arithmetic, which this follows (one state per CFG branch there; both branches see the same
steps, so one decision per step serves both and the factors are per branch):

    step i computes when i < disable_cache_before_step, or (i - disable_cache_before_step - 1) %
    cache_interval == 0, or i >= disable_cache_after_step (when set); otherwise it is forecast.
    a computed step refreshes the factors: F_0 = features; F_{j+1} = (F_j - F_j(last)) / (i - last)
    for j < max_order while the last refresh had order j; all kept in taylor_factors_dtype.
    a forecast step returns sum_k F_k * d**k / k!, d = i - (step of the last refresh).

The decision reads no tensor: the schedule follows from the settings. The factors live in the
request's loop state (its TaylorState's `kept`, per branch, order 0 first) and are refreshed between steps by
`refreshed_factors`, a few elementwise ops on the device.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from fvgraph.caching.settings import CacheSettings, PolicyContext, ScheduledPolicy
from fvgraph.caching.taylor_steps import TaylorState

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TaylorSeerSettings(CacheSettings):
    """diffusers' `TaylorSeerCacheConfig` names; its module patterns are fixed to lite mode (above)."""

    method: Literal["taylorseer"] = "taylorseer"
    state_type: ClassVar[type] = TaylorState
    memo_keys: ClassVar[tuple[str, ...]] = ("last", "orders")  # what its policy's start() returns
    cache_interval: int = Field(5, ge=1, description="Steps from one full computation to the next after the warmup.")
    disable_cache_before_step: int = Field(
        3, ge=1, description="Steps 0 .. this - 1 always compute (step 0 has nothing to forecast from)."
    )
    disable_cache_after_step: int | None = Field(None, ge=1, description="Steps from this one on always compute.")
    max_order: int = Field(1, ge=0, le=4, description="The highest Taylor order (each order is one step kind's input set).")
    taylor_factors_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="The dtype the factors are kept in (diffusers' default: bfloat16)."
    )

    @model_validator(mode="after")
    def _after_is_after_before(self) -> TaylorSeerSettings:
        after = self.disable_cache_after_step
        if after is not None and after < self.disable_cache_before_step:
            raise ValueError(f"disable_cache_after_step={after} must be >= disable_cache_before_step="
                             f"{self.disable_cache_before_step}, or None")  # fmt: skip
        return self

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> TaylorSeer:
        device = None if context is None else next(context.transformer.parameters()).device
        return TaylorSeer(self, num_inference_steps, device)


class TaylorSeer(ScheduledPolicy):
    """One request's TaylorSeer decisions; `memo` holds the step of the last refresh and its order count."""

    def __init__(self, settings: TaylorSeerSettings, num_inference_steps: int, device: torch.device | None):
        self.settings = settings
        self.max_order = settings.max_order
        self.factors_dtype = DTYPES[settings.taylor_factors_dtype]
        self.device = device
        self._rows: dict[tuple[int, int], torch.Tensor] = {}  # forecast coefficients by (distance, orders)

    def start(self) -> dict[str, float]:
        return {"last": -1, "orders": 0}

    def computes(self, step_index: int) -> bool:
        s = self.settings
        return (step_index < s.disable_cache_before_step
                or (step_index - s.disable_cache_before_step - 1) % s.cache_interval == 0
                or (s.disable_cache_after_step is not None and step_index >= s.disable_cache_after_step))  # fmt: skip

    def decide(self, memo: dict[str, float], step_index: int, has_kept: bool) -> tuple[bool, dict[str, float]]:
        """(compute, memo after this step): True when step `step_index` runs the denoiser."""
        if has_kept and not self.computes(step_index):
            return False, memo
        orders = min(int(memo["orders"]) + 1, self.max_order + 1) if memo["last"] >= 0 else 1
        return True, {"last": step_index, "orders": orders}

    def forecast_coeffs(self, memo: dict[str, float], step_index: int) -> torch.Tensor:
        """[1, orders] float32: d**k / k! for the forecast at `step_index` (a per-row step input, so
        requests at different distances share one graph). diffusers multiplies by the same Python
        number, which a float32 tensor op rounds to float32. A request has few distinct rows: each is
        copied to the device once."""
        key = (step_index - int(memo["last"]), int(memo["orders"]))
        if key not in self._rows:
            d, orders = key
            row = [(d**k) / math.factorial(k) for k in range(orders)]
            self._rows[key] = torch.tensor([row], dtype=torch.float32, device=self.device)
        return self._rows[key]

    def forecast_inputs(self, kept: list[torch.Tensor], memo: dict[str, float], step_index: int) -> dict[str, torch.Tensor]:
        """The forecast step's extra inputs: each branch's factors ("taylor_{b}_{k}") and the coefficients."""
        orders = int(memo["orders"])
        inputs = {f"taylor_{b}_{k}": kept[b * orders + k] for b in range(len(kept) // orders) for k in range(orders)}
        inputs["taylor_coeffs"] = self.forecast_coeffs(memo, step_index)
        return inputs

    def kept_after(self, kept: list[torch.Tensor], memo: dict[str, float], step_index: int,
                   result: dict[str, torch.Tensor], branches: int) -> list[torch.Tensor]:  # fmt: skip
        """The kept factors after a computed step: per branch (cond first) its refreshed factors, order 0 first."""
        orders = int(memo["orders"])
        refreshed = [self.refreshed_factors(kept[b * orders : (b + 1) * orders], memo, step_index, result[f"features_{b}"])
                     for b in range(branches)]  # fmt: skip
        return [factor for factors in refreshed for factor in factors]

    def refreshed_factors(self, factors: list[torch.Tensor], memo: dict[str, float], step_index: int,
                          features: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
        """One branch's factors after a computed step that returned `features` (diffusers'
        TaylorSeerState.update, op for op)."""
        new = [features]
        if memo["last"] >= 0:
            delta = step_index - int(memo["last"])
            for j in range(min(self.max_order, len(factors))):
                new.append((new[j] - factors[j].to(features.dtype)) / delta)
        return [factor.to(self.factors_dtype) for factor in new]
