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
import math
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
        _check_values(path, values)
        _check_tensors(path, tensors, values["guidance_scale"] > 1)
        return cls(**values, **{name: tensors.get(name) for name in TENSORS})


# The record's fields besides its tensors, with the types a saved one must hold (JSON's).
_VALUES = {"request_id": (str,), "seed": (int,), "noise_level": (int, float), "guidance_scale": (int, float),
           "group": (int, type(None)), "provenance": (dict,)}  # fmt: skip


def _check_values(path: str | Path, values) -> None:
    """ValueError naming the file and the field for metadata a saved record cannot hold."""
    if not isinstance(values, dict):
        raise ValueError(f"{path}: the record's metadata is a {type(values).__name__}, not an object of its fields")
    missing, unknown = sorted(set(_VALUES) - set(values) - {"group", "provenance"}), sorted(set(values) - set(_VALUES))
    if missing or unknown:
        raise ValueError(f"{path}: the record's metadata " + (f"lacks {', '.join(missing)}" if missing else f"has unknown fields {', '.join(unknown)}"))
    for name, kinds in _VALUES.items():
        value = values.get(name)
        if name in values and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise ValueError(f"{path}: field {name}={value!r} must be {' or '.join(k.__name__ for k in kinds)}")
    for name in ("noise_level", "guidance_scale"):
        if not math.isfinite(values[name]):
            raise ValueError(f"{path}: field {name}={values[name]!r} must be finite")


def _check_tensors(path: str | Path, tensors: dict[str, torch.Tensor], cfg: bool) -> None:
    """ValueError naming the file and the tensor for a missing one or shapes that do not agree."""
    required = [name for name in TENSORS if name != "negative_prompt_embeds" or cfg]
    for name in required:
        if name not in tensors:
            raise ValueError(f"{path}: the record has no {name!r} tensor" + (" (guidance_scale > 1 needs it)" if name.startswith("negative") else ""))
    steps = tensors["timesteps"].shape[0] if tensors["timesteps"].ndim == 1 else -1
    expected = {"timesteps": (steps,), "coeffs": (steps, 4), "log_probs": (steps,)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape or steps < 1:
            raise ValueError(f"{path}: tensor {name!r} has shape {list(tensors[name].shape)}, expected {list(shape)} "
                             "(N steps: timesteps [N], coeffs [N, 4], log_probs [N])")  # fmt: skip
    if tensors["latents"].ndim < 2 or tensors["latents"].shape[0] != steps + 1:
        raise ValueError(f"{path}: tensor 'latents' has shape {list(tensors['latents'].shape)}, expected [{steps + 1}, ...] (N + 1)")
