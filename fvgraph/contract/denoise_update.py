"""The end of every denoise step, whichever denoiser ran and whatever step caching skipped: the
guidance combine of the CFG branches and the sampler update, with each row's own scale and
coefficients (per-request [B] / [B, n] tensors, never Python numbers, so one graph serves all)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch


class Sampler(Protocol):
    """The in-graph half of a sampler (fvgraph/loops/samplers.py): a fixed linear combination."""

    num_carry: int  # history tensors the update takes and returns ("carry_0" ..)
    draws_noise: bool  # whether the update takes fresh noise (the step's "fresh_noise" input); it then
    # may also return the transition's log-probability [B] as a third value (an SDE sampler's)

    def update(self, sample: torch.Tensor, model_output: torch.Tensor, carry: tuple[torch.Tensor, ...],
               coeffs: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...  # fmt: skip


def carry_names(num_carry: int) -> tuple[str, ...]:
    """The step inputs and outputs that hold the sampler's history."""
    return tuple(f"carry_{i}" for i in range(num_carry))


def guided(noise: torch.Tensor, noise_uncond: torch.Tensor, guidance_scale: torch.Tensor) -> torch.Tensor:
    """The guidance combine, uncond + scale * (cond - uncond), with each row's own scale."""
    scale = guidance_scale.to(noise.dtype).view(-1, *([1] * (noise.dim() - 1)))
    return noise_uncond + scale * (noise - noise_uncond)


def sampler_update(sampler: Sampler, latents: torch.Tensor, noise: torch.Tensor, carry: Mapping[str, torch.Tensor],
                   coeffs: torch.Tensor, fresh_noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The sampler update from the step's noise prediction (and, for a re-noising sampler, the fresh
    noise the loop drew): "latents" and the new history "carry_i"."""
    names = carry_names(sampler.num_carry)
    history = tuple(carry[name] for name in names)
    if not sampler.draws_noise:
        new_latents, new_history = sampler.update(latents, noise, history, coeffs)
        return {"latents": new_latents, **dict(zip(names, new_history))}
    if fresh_noise is None:
        raise ValueError("this sampler draws noise at every step: the step needs its 'fresh_noise' input")
    new_latents, new_history, *log_prob = sampler.update(latents, noise, history, coeffs, fresh_noise)
    out = {"latents": new_latents, **dict(zip(names, new_history))}
    if log_prob:  # an SDE sampler's log-probability of the transition, [B]
        out["log_prob"] = log_prob[0]
    return out
