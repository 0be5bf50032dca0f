"""Grouped RL rollouts on the serving loop (the Engine's `rollout` delegates here).

    records = engine.rollout(["a red fox", "a lighthouse"], group_size=8, seed=7, num_inference_steps=10)

Each prompt is one group of `group_size` samples: its text is encoded once, and its samples are
requests with those embeddings (with the text itself, on a loop whose requests cannot carry its
encoded texts: HunyuanVideo-1.5's masks and ByT5 embeddings), the same schedule and guidance, and seeds derived from (seed, group,
sample), so they run as one homogeneous batch beside the other groups. Each sample comes back as a
BehaviorRecord (fvgraph/behavior.py) with `group` set to its prompt's index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fvgraph.behavior import BehaviorRecord, RolloutSampling
from fvgraph.contract.loop import LoopState
from fvgraph.engine.fold_back import StepCallback
from fvgraph.request import Request, Result


def sample_seed(seed: int, group: int, sample: int) -> int:
    """A sample's own seed: well mixed from (seed, group, sample), reproducible anywhere."""
    return int(np.random.SeedSequence((seed, group, sample)).generate_state(1, np.uint64)[0] % (2**63))


class Rollouts:
    """Handed the three engine calls a rollout is made of: `start` (a request's loop state), `step` (its
    next step: the text encode) and `generate` (the samples, interleaved)."""

    def __init__(self, start: Callable[[Request], LoopState], step: Callable[[LoopState, StepCallback | None], bool],
                 generate: Callable[..., list[Result]]):  # fmt: skip
        self._start, self._step, self._generate = start, step, generate

    def rollout(self, prompts: Sequence[str], group_size: int, seed: int, noise_level: float = 0.7,
                on_step: StepCallback | None = None, **fields) -> list[BehaviorRecord]:  # fmt: skip
        """One BehaviorRecord per sample, group by group. `fields` are Request's (num_inference_steps,
        guidance_scale, negative_prompt, sizes, loras, ...); `on_step` is generate's. A sample that does
        not come back 'ok' raises RuntimeError naming it and its error."""
        if isinstance(prompts, str) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompt texts")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} must be an int >= 1")
        for name in ("prompt", "prompt_embeds", "negative_prompt_embeds", "seed", "rollout", "output_type"):
            if name in fields:
                raise ValueError(f"rollout() sets {name} itself; pass prompts, seed and noise_level instead")
        sampling = RolloutSampling(noise_level=noise_level)
        requests = []
        for group, prompt in enumerate(prompts):
            texts = self._encoded(Request(prompt=prompt, seed=seed, output_type="latent", **fields), on_step)
            for sample in range(group_size):
                requests.append(Request(**{**fields, "negative_prompt": None, **texts}, seed=sample_seed(seed, group, sample),
                                        rollout=sampling, output_type="latent",
                                        request_id=f"rollout-{seed}-{group}-{sample}"))  # fmt: skip
        results = self._generate(requests, on_step=on_step)
        records = []
        for i, result in enumerate(results):
            if not result.ok:
                raise RuntimeError(f"rollout sample {result.request_id} ended {result.status}: {result.error}")
            result.record.group = i // group_size
            records.append(result.record)
        return records

    def _encoded(self, request: Request, on_step: StepCallback | None) -> dict:
        """The request's text encoded once, as prompt embeddings a group's samples share: its first
        step alone (the text encode), and the state then dropped. A loop whose requests cannot carry
        its encoded texts (`embeds_given`) gets the texts: each sample encodes the same tokens."""
        state = self._start(request)
        if not state.embeds_given:
            return {"prompt": request.prompt, "negative_prompt": request.negative_prompt}
        if state.phase == "encode":
            self._step(state, on_step)
        embeds = {"prompt_embeds": state.prompt_embeds[0]}
        if state.negative_prompt_embeds is not None:
            embeds["negative_prompt_embeds"] = state.negative_prompt_embeds[0]
        return embeds
