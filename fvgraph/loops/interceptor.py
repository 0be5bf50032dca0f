"""Interceptors: step caching chosen per request and decided by the loop between steps.

A request picks a method with `Request(cache={"method": "magcache", ...})`. The method never runs
inside a step. Before each denoise step the loop asks the request's policy whether the step computes
the denoiser's transformer blocks or reuses what the last full step kept, and emits the step kind
that does it (fvgraph/loops/cached_denoise.py):

    denoise[_cfg]_keep    the whole step; it also returns, per CFG branch, the residual the block
                          stack added to its input ("kept_0", "kept_1")
    denoise[_cfg]_reuse   the step with the block stack replaced by adding the kept residual

Both are ordinary step kinds, each compiled (and at -O2 graphed) under its own signature, so a
decision costs no graph break and no host sync: requests that compute and requests that reuse run
as separate groups of one tick. The policy's accumulators (plain Python numbers) and the kept
tensors live in the request's loop state, so a state saved between two steps resumes with the same
decisions, and no state is shared between requests or kept in a module.

A method is one file: a settings model (a `CacheSettings`, with diffusers' field names where
diffusers has the method) and a policy with

    start() -> memo                                    the accumulators before the first step
    decide(memo, step_index, has_kept) -> (compute, memo)   pure: the same arguments give the same answer

listed by import path in METHODS. A policy whose schedule is known ahead (MagCache) reads no tensor.
A data-dependent policy (FBCache, fvgraph/loops/fb_cache.py) is a MeasuringInterceptor instead: the
loop runs each step as two launches, a measuring one and the rest, and the policy decides per CFG
branch in between from one small output of the first that the runtime copies to the host for the
whole group at once (StepKind.host_outputs).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

# method name -> "module:SettingsClass"; imported on first use.
METHODS: dict[str, str] = {
    "magcache": "fvgraph.loops.mag_cache:MagCacheSettings",
    "fbcache": "fvgraph.loops.fb_cache:FirstBlockCacheSettings",
}


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

    def policy(self, num_inference_steps: int) -> Interceptor | MeasuringInterceptor:
        raise NotImplementedError(f"cache method {self.method!r} builds no policy")

    def check_steps(self, num_inference_steps: int) -> tuple[str, str] | None:
        """(field, message) when these settings cannot serve a request of that many steps, else None."""
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
