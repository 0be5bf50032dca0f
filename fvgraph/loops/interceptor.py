"""Interceptors: step caching chosen per request and decided by the loop between steps.

A request picks a method with `Request(cache={"method": "magcache", ...})`. The method never runs
inside a step. Before each denoise step the loop asks the request's policy whether the step computes
the denoiser's transformer blocks or reuses what the last full step kept, and emits the step kind
that does it (fvgraph/loops/cached_denoise.py):

    denoise[_cfg]_keep    the whole step; it also returns, per CFG branch, the residual the block
                          stack added to its input ("kept_0", "kept_1")
    denoise[_cfg]_reuse   the step with the block stack replaced by adding the kept residual

(TaylorSeer, which keeps each branch's noise prediction instead, has kinds of its own:
fvgraph/loops/taylor_denoise.py; its policy says so with `step_family = "taylor"`.)

Both are ordinary step kinds, each compiled (and at -O2 graphed) under its own signature, so a
decision costs no graph break and no host sync: requests that compute and requests that reuse run
as separate groups of one tick. The policy's accumulators (plain Python numbers) and the kept
tensors live in the request's loop state, so a state saved between two steps resumes with the same
decisions, and no state is shared between requests or kept in a module.

A method is one file: a settings model (a `CacheSettings`, with diffusers' field names where
diffusers has the method) and a policy with

    start() -> memo                                    the accumulators before the first step
    decide(memo, step_index, has_kept) -> (compute, memo)   pure: the same arguments give the same answer

listed by import path in METHODS. A policy whose schedule is known ahead reads no tensor between
steps: MagCache's follows from its settings; TeaCache's from the request's timesteps and the
denoiser's condition embedder, which the loop hands over in a PolicyContext when it builds the policy.
A data-dependent policy (FBCache, fvgraph/loops/fb_cache.py) is a MeasuringInterceptor instead: the
loop runs each step as two launches, a measuring one and the rest, and the policy decides per CFG
branch in between from one small output of the first that the runtime copies to the host for the
whole group at once (StepKind.host_outputs).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

if TYPE_CHECKING:
    from fvgraph.card import ModelCard

# method name -> "module:SettingsClass"; imported on first use.
METHODS: dict[str, str] = {
    "magcache": "fvgraph.loops.mag_cache:MagCacheSettings",
    "teacache": "fvgraph.loops.tea_cache:TeaCacheSettings",
    "taylorseer": "fvgraph.loops.taylor_seer:TaylorSeerSettings",
    "fbcache": "fvgraph.loops.fb_cache:FirstBlockCacheSettings",
}


@dataclass(frozen=True)
class PolicyContext:
    """What the loop knows of a request when it builds the request's policy (when the request is
    initialised, and again after a resume), for methods that plan from more than the step count."""

    timesteps: torch.Tensor  # [N] the request's timesteps, as the scheduler emits them
    transformer: nn.Module  # the denoiser, on the engine's device
    embed_dtype: torch.dtype  # the dtype the text embeddings enter the denoiser in
    card: ModelCard


class Interceptor(Protocol):
    """One request's caching policy, built from its settings and step count (host-side only)."""

    def start(self) -> dict[str, float]: ...

    def decide(self, memo: dict[str, float], step_index: int, has_kept: bool) -> tuple[bool, dict[str, float]]: ...


class MeasuringInterceptor(Protocol):
    """A policy decided from the step's own data: `measures` names the output of the loop's measuring
    launch it reads (on the host, [branches, ...] per request); the answer is one decision per branch."""

    measures: str

    def start(self) -> dict[str, float]: ...

    def decide_branches(self, memo: dict[str, float], step_index: int, change: torch.Tensor,
                        has_kept: bool) -> tuple[tuple[bool, ...], dict[str, float]]: ...  # fmt: skip


class CacheSettings(BaseModel):
    """Base of every method's settings: frozen, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> Interceptor | MeasuringInterceptor:
        raise NotImplementedError(f"cache method {self.method!r} builds no policy")

    def check_steps(self, num_inference_steps: int) -> tuple[str, str] | None:
        """(field, message) when these settings cannot serve a request of that many steps, else None."""
        return None

    def kept_layout(self, memo: dict[str, float]) -> tuple[int, int]:
        """(tensors per CFG branch, dims of each) that `cache_kept` holds once a step computed, given
        the policy's memo: one residual [1, S, D] per branch unless the method keeps something else."""
        return 1, 3

    def check_card(self, card: ModelCard) -> tuple[str, str] | None:
        """(field, message) when these settings cannot serve a request on that card, else None."""
        return None


def settings_type(method: str) -> type[CacheSettings]:
    module, name = METHODS[method].split(":")
    return getattr(importlib.import_module(module), name)


def parse_cache_settings(value: Any) -> CacheSettings | None:
    """A request's `cache` value as its method's settings. ValueError names the field and the rule:
    `cache.method` for an unknown method, `cache.<field>` for an unknown or invalid field."""
    if value is None or isinstance(value, CacheSettings):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"cache must be a dict with a 'method' key (one of {', '.join(METHODS)}), got {type(value).__name__}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"cache.method={method!r} is not a known method; known methods: {', '.join(METHODS)}")
    try:
        return settings_type(method).model_validate(dict(value))
    except ValidationError as err:
        problems = "; ".join(f"cache.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ValueError(f"cache method {method!r}: {problems}") from None
