"""MagCache (Ma et al., github.com/Zehong-Ma/MagCache) as a step-caching method: its schedule reads no tensor.

MagCache skips the transformer blocks at a step when the magnitude of the blocks' residual is
predicted to change little since the last full step. The prediction is a per-step ratio calibrated
once per model (`mag_ratios`), so whether step i computes depends only on the settings and the step
index: the whole schedule is known before the run and no device value is read to decide.

The decision follows diffusers' `MagCacheHeadHook` (diffusers.hooks.mag_cache, 0.42.1) step for step,
in its float32 arithmetic (its accumulators become float32 tensors once multiplied by a ratio):

    steps before round(retention_ratio * num_inference_steps) always compute; after them
    ratio *= mag_ratios[i]; skipped += 1; err += |1 - ratio|
    reuse if a residual is kept and err <= threshold and skipped <= max_skip_steps,
    else compute and reset (ratio 1, skipped 0, err 0)

diffusers keeps one state per CFG branch (WanPipeline's cache_context "cond" / "uncond"); both see
the same step sequence and decide alike, so one decision per step serves both branches, while the
kept residual is per branch.

`mag_ratios` may be left out: `fvgraph calibrate` measures them on the loaded weights
(`MagCacheCalibration`, diffusers' `MagCacheConfig(calibrate=True)` formula) and the loop fills them
in from what it stored for those weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from fvgraph.caching.residual_steps import RESIDUAL_KINDS, ResidualState
from fvgraph.caching.settings import CacheSettings, PolicyContext, ScheduledPolicy

Ratio = Annotated[float, Field(gt=0, allow_inf_nan=False)]
KEEP_KINDS = frozenset(kind for (_, reuse), kind in RESIDUAL_KINDS.items() if not reuse)


class MagCacheSettings(CacheSettings):
    """diffusers' `MagCacheConfig` names; its `calibrate` mode is `fvgraph calibrate` here."""

    method: Literal["magcache"] = "magcache"
    state_type: ClassVar[type] = ResidualState
    memo_keys: ClassVar[tuple[str, ...]] = ("ratio", "skipped", "err")  # what its policy's start() returns
    threshold: float = Field(0.06, ge=0, allow_inf_nan=False, description="Accumulated error up to which steps reuse.")
    max_skip_steps: int = Field(3, ge=0, description="The most consecutive steps that reuse (K in the paper).")
    retention_ratio: float = Field(0.2, ge=0, le=1, description="Fraction of the first steps that always compute.")
    num_inference_steps: int | None = Field(
        None, ge=1, description="The steps `mag_ratios` are interpolated to; default and only allowed value: the request's."
    )
    mag_ratios: tuple[Ratio, ...] | None = Field(
        None, min_length=1, description="Per-step magnitude ratios calibrated for the model (nearest-interpolated to "
        "the steps); left out: the ones `fvgraph calibrate` stored for the loaded weights.",
    )  # fmt: skip

    def missing_calibration(self) -> tuple[str, ...]:
        return ("mag_ratios",) if self.mag_ratios is None else ()

    @classmethod
    def calibration(cls) -> MagCacheCalibration:
        return MagCacheCalibration()

    def check_steps(self, num_inference_steps: int) -> tuple[str, str] | None:
        if self.num_inference_steps is not None and self.num_inference_steps != num_inference_steps:
            return ("cache.num_inference_steps", f"{self.num_inference_steps} differs from the request's "
                    f"num_inference_steps={num_inference_steps}; MagCache plans one run of the request's steps")  # fmt: skip
        return None

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> MagCache:
        return MagCache(self, num_inference_steps)


def nearest_interp(ratios: torch.Tensor, steps: int) -> torch.Tensor:
    """`ratios` resampled to `steps` entries by nearest index; equals diffusers'
    `diffusers.hooks.mag_cache.nearest_interp` (0.42.1; tests/test_mag_cache.py compares them)."""
    if steps == 1:
        return ratios[-1:]
    scale = (len(ratios) - 1) / (steps - 1)
    grid = torch.arange(steps, device=ratios.device, dtype=torch.float32)
    return ratios[torch.round(grid * scale).long()]


class MagCache(ScheduledPolicy):
    """One request's MagCache decisions; `memo` holds diffusers' three accumulators."""

    def __init__(self, settings: MagCacheSettings, num_inference_steps: int):
        if settings.mag_ratios is None:
            raise ValueError("cache.mag_ratios: MagCache needs calibrated ratios (give them, or run `fvgraph calibrate`)")
        ratios = torch.tensor(settings.mag_ratios)  # float32, as MagCacheConfig turns a list into a tensor
        if len(ratios) != num_inference_steps:
            ratios = nearest_interp(ratios, num_inference_steps)
        self.ratios = [np.float32(r) for r in ratios.tolist()]
        self.retention_step = int(settings.retention_ratio * num_inference_steps + 0.5)
        self.threshold = np.float32(settings.threshold)  # torch compares a float32 tensor with a float in float32
        self.max_skip_steps = settings.max_skip_steps

    def start(self) -> dict[str, float]:
        return {"ratio": 1.0, "skipped": 0, "err": 0.0}

    def decide(self, memo: dict[str, float], step_index: int, has_kept: bool) -> tuple[bool, dict[str, float]]:
        """(compute, memo after this step): True when step `step_index` must run the blocks."""
        if step_index < self.retention_step:
            return True, memo
        scale = self.ratios[step_index] if step_index < len(self.ratios) else np.float32(1.0)
        ratio = np.float32(memo["ratio"]) * scale
        err = np.float32(memo["err"]) + abs(np.float32(1.0) - ratio)
        skipped = int(memo["skipped"]) + 1
        if has_kept and err <= self.threshold and skipped <= self.max_skip_steps:
            return False, {"ratio": float(ratio), "skipped": skipped, "err": float(err)}
        return True, self.start()


class MagCacheCalibration:
    """diffusers' calibration formula on the cond branch's residuals of an uncached run:
    ratio[0] = 1, ratio[i] = mean over tokens of |r_i| / (|r_{i-1}| + 1e-8), |.| the L2 norm of a token."""

    def __init__(self):
        self.previous: torch.Tensor | None = None
        self.ratios: list[float] = []

    def settings(self) -> MagCacheSettings:
        return MagCacheSettings(max_skip_steps=0, mag_ratios=(1.0,))  # every step computes and keeps

    def reads(self, kind: str) -> bool:
        return kind in KEEP_KINDS  # a full step: it returns the blocks' residuals

    def observe(self, step_index: int, outputs: Mapping[str, Any]) -> None:
        if step_index != len(self.ratios):
            raise ValueError(f"calibration saw step {step_index} after {len(self.ratios)} steps: run one request alone")
        norm = torch.linalg.norm(outputs["kept_0"].float(), dim=-1)  # [B, S]: the cond branch, as diffusers' first context
        self.ratios.append(1.0 if self.previous is None else (norm / (self.previous + 1e-8)).mean().item())
        self.previous = norm

    def values(self) -> dict[str, Any]:
        return {"mag_ratios": list(self.ratios)}
