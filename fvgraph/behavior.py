"""RL rollouts on the serving loops: how a request asks to be sampled as a rollout, and the record
of what it did (docs/rollouts.md).

    Request(prompt="a red fox", seed=3, rollout=RolloutSampling(noise_level=0.7))
    result.record.log_probs        # [N]: log p(x_{i+1} | x_i) of each transition it took
    result.record.save("r.safetensors"); BehaviorRecord.load("r.safetensors")

A rollout request runs Flow-GRPO's SDE step (fvgraph/loops/samplers.py FlowSdeSampler) inside the same
compiled denoise step as any request, with its fresh noise from the request's own generator, and
records at generation time what a trainer needs to recompute each transition's log-probability with
the model in train mode: the latents before and after every transition, the timesteps and sampler
rows, the conditioning, and what produced it (weights and adapter versions, precision, opt level,
attention backend, parallel plan).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

TENSORS = ("timesteps", "coeffs", "latents", "log_probs", "prompt_embeds", "negative_prompt_embeds")


class RolloutSampling(BaseModel):
    """Sample as a rollout: the SDE form of flow-matching Euler at `noise_level` (Flow-GRPO's eta)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    noise_level: float = Field(default=0.7, gt=0.0, le=2.0, description="Flow-GRPO's noise_level (eta): 0.7 in its configs.")


@dataclass
class BehaviorRecord:
    """One rollout sample as it was generated. Tensors are CPU float32 (embeddings in the denoiser's dtype)."""

    request_id: str
    seed: int
    noise_level: float
    guidance_scale: float  # > 1: CFG ran, and `negative_prompt_embeds` is set
    timesteps: torch.Tensor  # [N], what the denoiser saw at each step
    coeffs: torch.Tensor  # [N, 4] the SDE rows [sigma, a, b, c]: mean = a x + b v, x' = mean + c noise
    latents: torch.Tensor  # [N + 1, C, F, h, w]: before the first transition, then after each
    log_probs: torch.Tensor  # [N] float32, log p(latents[i + 1] | latents[i]) averaged over elements
    prompt_embeds: torch.Tensor  # [L, D]
    negative_prompt_embeds: torch.Tensor | None = None  # [L, D] when guidance_scale > 1
    group: int | None = None  # Engine.rollout: the index of its prompt
    provenance: dict = field(default_factory=dict)  # card, weights and adapter versions, precision, opt level, ...

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    def save(self, path: str | Path) -> Path:
        """One safetensors file: the tensors, and the rest as JSON in its metadata."""
        tensors = {name: getattr(self, name).contiguous() for name in TENSORS if getattr(self, name) is not None}
        values = {k: v for k, v in asdict(self).items() if k not in TENSORS}
        save_file(tensors, str(path), metadata={"fvgraph.behavior_record": json.dumps(values)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> BehaviorRecord:
        """ValueError naming the file for one that is not a saved record."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
            values = json.loads(meta["fvgraph.behavior_record"])
            tensors = load_file(str(path))
        except Exception as err:  # unreadable, not safetensors, or no record in its metadata
            raise ValueError(f"{path}: not a saved BehaviorRecord ({err})") from None
        return cls(**values, **{name: tensors.get(name) for name in TENSORS})
