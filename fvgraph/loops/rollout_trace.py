"""A rollout request's own state: its SDE noise level and what each transition recorded.

One field of the loop state (`DenoiseState.rollout`), saved with it as plain values; the loop's
rollout part (fvgraph/loops/loop_rollouts.py) fills it and builds the BehaviorRecord from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RolloutTrace:
    noise_level: float  # Flow-GRPO's SDE noise level
    latents: list[torch.Tensor] = field(default_factory=list)  # before the first transition, then after each
    log_probs: list[float] = field(default_factory=list)  # one per transition taken

    def saved(self) -> dict[str, Any]:
        return {"noise_level": self.noise_level, "latents": list(self.latents), "log_probs": list(self.log_probs)}

    @classmethod
    def load(cls, value: Any) -> RolloutTrace:
        """Read back what `saved()` wrote; ValueError, naming the part, for anything else. What the
        values must hold at the state's progress is the loop's check on resume."""
        if not isinstance(value, dict) or set(value) != {"noise_level", "latents", "log_probs"}:
            raise ValueError("must be a dict with 'noise_level', 'latents' and 'log_probs'")
        level, latents, log_probs = value["noise_level"], value["latents"], value["log_probs"]
        if isinstance(level, bool) or not isinstance(level, float | int) or not 0 < level <= 2:
            raise ValueError(f"noise_level must be a number in (0, 2], got {level!r}")
        if not isinstance(latents, list) or not all(isinstance(t, torch.Tensor) for t in latents):
            raise ValueError("latents must be a list of tensors")
        if not isinstance(log_probs, list) or not all(isinstance(v, float) and math.isfinite(v) for v in log_probs):
            raise ValueError("log_probs must be a list of finite floats")
        return cls(float(level), latents, log_probs)

    def to(self, device: torch.device) -> None:
        self.latents = [t.to(device) for t in self.latents]
