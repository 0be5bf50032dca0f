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

The same settings are spelled three ways: a dict (`{"method": "magcache", "threshold": 0.1}`), the
text `METHOD[:k=v,...]` (`magcache:threshold=0.1`, each value read as JSON, else as a string: what
`--cache` and an HTTP form take), or the word `none`, which turns caching off where a card default
would otherwise apply (`NoCache`). Settings a method calibrates per model (MagCache's `mag_ratios`)
may be left out; `calibrated()` fills them from what `fvgraph calibrate` stored for the loaded
weights (fvgraph/loops/cache_calibration.py).
"""

from __future__ import annotations

import importlib
import json
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

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
    card: Any  # the ModelCard (fvgraph/card.py imports this module for its default_cache)


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

    @abstractmethod
    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> Interceptor | MeasuringInterceptor:
        """The request's decisions, built once per request on the host (each method's file)."""

    def check_steps(self, num_inference_steps: int) -> tuple[str, str] | None:
        """(field, message) when these settings cannot serve a request of that many steps, else None."""
        return None

    def kept_layout(self, memo: dict[str, float]) -> tuple[int, int]:
        """(tensors per CFG branch, dims of each) that `cache_kept` holds once a step computed, given
        the policy's memo: one residual [1, S, D] per branch unless the method keeps something else."""
        return 1, 3

    def check_card(self, card: Any) -> tuple[str, str] | None:
        """(field, message) when these settings cannot serve a request on that card, else None."""
        return None

    def missing_calibration(self) -> tuple[str, ...]:
        """The fields left out that the method calibrates per model (filled by `calibrated`)."""
        return ()

    def calibrated(self, values: Mapping[str, Any]) -> CacheSettings:
        """These settings with the missing calibrated fields taken from `values` (what `fvgraph
        calibrate` stored for the loaded weights); fields given explicitly win."""
        missing = {name: values[name] for name in self.missing_calibration() if name in values}
        return type(self).model_validate({**self.model_dump(), **missing}) if missing else self

    def diffusers_config(self, num_inference_steps: int) -> Any | None:
        """The same settings as the diffusers hook config `transformer.enable_cache()` takes (for
        comparisons with diffusers), or None where diffusers has no such method."""
        return None

    @classmethod
    def calibration(cls) -> Calibration | None:
        """How `fvgraph calibrate` measures this method's calibrated fields; None: it has none."""
        return None


class Calibration(Protocol):
    """Measures a method's calibrated fields from one uncached run's full steps."""

    def settings(self) -> CacheSettings:
        """Settings under which every step computes and keeps what the measurement reads."""
        ...

    def observe(self, step_index: int, outputs: Mapping[str, Any]) -> None: ...

    def values(self) -> dict[str, Any]:
        """The calibrated fields, by name, as the settings take them."""
        ...


class NoCache(CacheSettings):
    """Caching off: what `cache="none"` means, also where the card names a default."""

    method: Literal["none"] = "none"

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> Interceptor:
        # Request.caching is None for these settings, so no loop asks; a caller that does is told why.
        raise ValueError('cache="none" turns step caching off: it has no policy')


NO_CACHE = "none"


def settings_type(method: str) -> type[CacheSettings]:
    module, name = METHODS[method].split(":")
    return getattr(importlib.import_module(module), name)


def parse_cache_text(text: str) -> dict[str, Any]:
    """`METHOD[:k=v,...]` (or a JSON object) as a settings dict; `none` as {"method": "none"}. A value
    is read as JSON (numbers, booleans, [lists]) and otherwise kept as a string; commas inside
    brackets belong to the value. ValueError names what is malformed."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as err:
            raise ValueError(f"cache={text!r} is not a JSON object: {err}") from None
        if not isinstance(value, dict):
            raise ValueError(f"cache={text!r} must be a JSON object")
        return value
    method, _, rest = text.partition(":")
    settings: dict[str, Any] = {"method": method.strip()}
    for item in _top_level_items(rest):
        name, eq, raw = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"cache={text!r}: {item!r} must be key=value (e.g. magcache:threshold=0.1)")
        try:
            settings[name.strip()] = json.loads(raw)
        except ValueError:
            settings[name.strip()] = raw.strip()
    return settings


def _top_level_items(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_cache_settings(value: Any) -> CacheSettings | None:
    """A request's `cache` value as its method's settings: a dict, the text `METHOD[:k=v,...]`, or
    `none` (NoCache). ValueError names the field and the rule: `cache.method` for an unknown method,
    `cache.<field>` for an unknown or invalid field."""
    if value is None or isinstance(value, CacheSettings):
        return value
    if isinstance(value, str):
        value = parse_cache_text(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"cache must be a dict with a 'method' key (one of {', '.join(METHODS)}) or the text "
                         f"METHOD[:k=v,...], got {type(value).__name__}")  # fmt: skip
    method = value.get("method")
    if method == NO_CACHE:
        extra = sorted(set(value) - {"method"})
        if extra:
            raise ValueError(f"cache.{extra[0]}: method 'none' (caching off) takes no settings")
        return NoCache()
    if not isinstance(method, str) or method not in METHODS:  # a list or an object is no name either
        raise ValueError(f"cache.method={method!r} is not a known method; known methods: {', '.join(METHODS)} "
                         f"('{NO_CACHE}' turns caching off)")  # fmt: skip
    try:
        return settings_type(method).model_validate(dict(value))
    except ValidationError as err:
        problems = "; ".join(f"cache.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ValueError(f"cache method {method!r}: {problems}") from None
