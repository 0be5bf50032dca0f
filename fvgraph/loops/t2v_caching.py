"""Step caching in the text-to-video loop: the step kinds a caching interceptor's requests run, and
the loop's side of it (fvgraph/loops/interceptor.py says what an interceptor is).

`StepCaching` is mixed into TextToVideoLoop: it checks a request's `cache` against the card and the
calibration store, starts the policy when the request starts, emits the step kind the policy decides
on before each denoise step (keep or reuse, TaylorSeer's keep or predict, FBCache's two launches),
folds what the step kept back into the state, and counts denoiser calls and FLOPs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fvgraph.loops.cached_denoise import CachedDenoiseStep
from fvgraph.loops.fb_cache import advance_first_block, after_first_variants, first_block_plan
from fvgraph.loops.fb_cache_steps import FB_STEP_KINDS, build_fb_steps
from fvgraph.loops.interceptor import Interceptor, PolicyContext, parse_cache_settings
from fvgraph.loops.loop import StepKind, StepResult, WorkPlan
from fvgraph.loops.step_flops import StepFlops, meta_twin
from fvgraph.loops.taylor_denoise import TaylorDenoiseStep
from fvgraph.request import Request, RequestRejected

# The denoise kinds of a request with a caching interceptor (fvgraph/loops/interceptor.py), by
# (cfg, reuse): a full step that keeps the blocks' residual, or one that reuses it.
CACHED_KINDS = {(cfg, reuse): f"denoise{'_cfg' if cfg else ''}_{'reuse' if reuse else 'keep'}"
                for cfg in (False, True) for reuse in (False, True)}  # fmt: skip
# TaylorSeer's (fvgraph/loops/taylor_seer.py), by (cfg, forecast): a full step that keeps each branch's
# noise prediction, or one that forecasts it from the kept Taylor factors.
TAYLOR_KINDS = {(cfg, forecast): f"denoise{'_cfg' if cfg else ''}_taylor_{'predict' if forecast else 'keep'}"
                for cfg in (False, True) for forecast in (False, True)}  # fmt: skip
CACHING_STEP_KINDS = {kind: StepKind(kind, component="transformer", phase="denoise", compiled=True, per_inference_step=True)
                      for kind in (*CACHED_KINDS.values(), *TAYLOR_KINDS.values())}  # fmt: skip
CACHING_STEP_KINDS.update(FB_STEP_KINDS)  # FBCache's two launches per step (fvgraph/loops/fb_cache_steps.py)


def caching_steps(transformer: nn.Module, sampler: Any) -> dict[str, nn.Module]:
    """The step module of every caching kind, on `transformer` (no weight copies)."""
    return {
        **{kind: CachedDenoiseStep(transformer, sampler, cfg, reuse) for (cfg, reuse), kind in CACHED_KINDS.items()},
        **{kind: TaylorDenoiseStep(transformer, sampler, cfg, forecast) for (cfg, forecast), kind in TAYLOR_KINDS.items()},
        **build_fb_steps(transformer, sampler),
    }


class StepCaching:
    """The text-to-video loop's step caching. Reads the loop's card, components, facts, calibration
    store, `_signatures`, `_flops` and `_denoise_steps`; the state is a T2VState."""

    def _check_caching(self, resolved: Request) -> Request:
        """`resolved` with its calibrated cache settings filled in; RequestRejected naming the field."""
        if resolved.caching is None:
            return resolved
        if self.takes_image or len(self.facts.experts) > 1:
            raise RequestRejected("cache", f"card {self.card.card_id!r} runs loop {self.loop_id!r}; step caching "
                                           "runs on single-expert text-to-video loops only")  # fmt: skip
        if problem := resolved.caching.check_card(self.card):
            raise RequestRejected(*problem)
        if resolved.caching.missing_calibration():
            resolved = resolved.model_copy(update={"cache": self._calibrated(resolved.caching)})
        return resolved

    def _calibrated(self, settings):
        """`settings` with their calibrated fields filled from the store, for these weights."""
        c, method = self.components, settings.method
        record = self.calibration.load(self.card.card_id, c.weights_version, method)
        missing = settings.missing_calibration()
        if record is None:
            raise RequestRejected(f"cache.{missing[0]}", f"not given, and none calibrated for card {self.card.card_id!r} "
                                  f"with weights {c.weights_version} under {self.calibration.root}: run `fvgraph calibrate "
                                  f"--card {self.card.card_id} [--checkpoint P] --steps N` or pass {missing[0]}")  # fmt: skip
        return settings.calibrated(record["values"])

    def warmup_variants(self, plan: WorkPlan) -> list[WorkPlan]:
        """The loop contract's warmup hook: FBCache's other second-launch patterns."""
        return after_first_variants(plan)

    def _start_caching(self, state: Any, request: Request) -> None:
        if request.caching is None:
            return
        state.cache = request.caching.model_dump(mode="json")
        # The policy is built here, before any step is queued: one that plans from the denoiser
        # (TeaCache runs its condition embedder on the timesteps) reads the device only now.
        state.cache_memo = self._policy(state).start()
        state.cache_counts = {"computed": 0, "reused": 0, "flops": 0, "flops_uncached": 0}

    def _policy(self, state: Any) -> Interceptor:
        if state.policy is None:
            context = PolicyContext(state.timesteps, self.components.transformer, self.embed_dtype, self.card)
            state.policy = parse_cache_settings(state.cache).policy(state.num_steps, context)
        return state.policy

    def _cached_plan(self, state: Any, facts: Any, inputs: dict[str, torch.Tensor]) -> WorkPlan:
        """The step the request's interceptor decides on: keep (blocks run) or reuse (blocks skipped).
        The decision is host arithmetic on the state; advance() repeats it to move the state on."""
        plain = dict(inputs)  # the uncached step's inputs, for its FLOPs
        policy = self._policy(state)
        if getattr(policy, "measures", None):  # decided from the step's own data: two launches (fb_cache.py)
            kind, inputs = first_block_plan(state, inputs, self.components.transformer)
        elif getattr(policy, "step_family", "residual") == "taylor":
            compute, _ = policy.decide(state.cache_memo, state.step_index, bool(state.cache_kept))
            if not compute:
                inputs.update(policy.forecast_inputs(state.cache_kept, state.cache_memo, state.step_index))
            kind = TAYLOR_KINDS[(state.cfg, not compute)]
        else:
            compute, _ = policy.decide(state.cache_memo, state.step_index, bool(state.cache_kept))
            if not compute:
                inputs.update({f"kept_{b}": t for b, t in enumerate(state.cache_kept)})
            kind = CACHED_KINDS[(state.cfg, not compute)]
        if self._flops is None:  # the denoise steps on a data-free twin of the denoiser
            self._flops = StepFlops(self._denoise_steps(meta_twin(self.components.transformer)))
        state.step_flops = (self._flops.count(kind, inputs), self._flops.count(facts.kind, plain))
        plan = WorkPlan(state.request_id, kind, inputs, state.step_index, facts.pixels, facts.constant_names)
        plan.signature = self._signatures.setdefault(plan.signature, plan.signature)
        return plan

    def _advance_cache(self, state: Any, result: StepResult) -> bool:
        """Fold the cache's outputs into the state; False when the step has a launch still to run."""
        policy, memo = self._policy(state), state.cache_memo
        ran, uncached = state.step_flops or (0, 0)
        state.cache_counts["flops"] = state.cache_counts.get("flops", 0) + ran
        if getattr(policy, "measures", None):
            done = advance_first_block(policy, state, result)
            if done:  # the uncached step counts once per step, not per launch
                state.cache_counts["flops_uncached"] = state.cache_counts.get("flops_uncached", 0) + uncached
            return done
        state.cache_counts["flops_uncached"] = state.cache_counts.get("flops_uncached", 0) + uncached
        compute, state.cache_memo = policy.decide(memo, state.step_index, bool(state.cache_kept))
        branches = 2 if state.cfg else 1
        if compute and getattr(policy, "step_family", "residual") == "taylor":
            state.cache_kept = policy.kept_after(state.cache_kept, memo, state.step_index, result, branches)
        elif compute:
            state.cache_kept = [result[f"kept_{b}"] for b in range(branches)]
        key = "computed" if compute else "reused"
        state.cache_counts[key] = state.cache_counts.get(key, 0) + branches
        return True
