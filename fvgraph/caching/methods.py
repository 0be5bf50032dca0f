"""The step-caching methods fvgraph knows, by name; the step kinds they add; the check of a
deployment's enabled methods; the parser of a request's `cache` value and the reader of a saved
caching state.

Adding a method: one file with its settings (a CacheSettings) and its decision, whose state and step
kinds are one of the step families below (or a new family file beside them), and one line here
(docs/step_caching.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError
from torch import nn

from fvgraph.caching import fb_cache_steps, residual_steps, taylor_steps, tea_probe_steps
from fvgraph.caching.fb_cache import FirstBlockCacheSettings
from fvgraph.caching.mag_cache import MagCacheSettings
from fvgraph.caching.settings import NO_CACHE, CacheSettings, NoCache, parse_cache_text
from fvgraph.caching.taylor_seer import TaylorSeerSettings
from fvgraph.caching.state import StepCachingState
from fvgraph.caching.tea_cache import TeaCacheSettings
from fvgraph.contract.denoise_update import Sampler
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import WorkPlan
from fvgraph.contract.saved_state import checked_fields
from fvgraph.contract.step_kind import StepKind

METHODS: dict[str, type[CacheSettings]] = {
    "magcache": MagCacheSettings,
    "teacache": TeaCacheSettings,
    "taylorseer": TaylorSeerSettings,
    "fbcache": FirstBlockCacheSettings,
}


# Each family: its step kinds (derived from the loop's denoise kinds), its step modules, its state type.
STEP_FAMILIES = (residual_steps, taylor_steps, fb_cache_steps, tea_probe_steps)


def step_families(teacache_signal: str) -> tuple:
    """The families a denoiser family runs: TeaCache's probe launch only where its signal is measured
    in the step ("modulated_input", DenoiserSections.teacache_signal), not planned ahead ("timestep")."""
    return STEP_FAMILIES if teacache_signal == "modulated_input" else STEP_FAMILIES[:-1]


def settings_type(method: str) -> type[CacheSettings]:
    return METHODS[method]


def enabled_methods(names: Iterable[str] | None) -> tuple[str, ...]:
    """The methods a deployment lets requests pick (`Engine.from_card(cache_methods=...)`), in METHODS'
    order: None is every method; an empty iterable, none (exact execution only). ValueError names
    `cache_methods`, the unknown name and the known methods."""
    if names is None:
        return tuple(METHODS)
    if isinstance(names, str):  # iterating it would check its letters
        raise ValueError(f"cache_methods={names!r} must be a list of method names (one of {', '.join(METHODS)}), "
                         "not a string")  # fmt: skip
    names = tuple(names)
    for name in names:
        if name not in METHODS:
            raise ValueError(f"cache_methods: {name!r} is not a step-caching method; known methods: {', '.join(METHODS)} "
                             "(an empty list enables none: exact execution only)")  # fmt: skip
    return tuple(method for method in METHODS if method in names)


def caching_step_kinds(denoise: Mapping[bool, StepKind], teacache_signal: str) -> dict[str, StepKind]:
    """Every kind a caching method adds, from the loop's plain denoise kind by CFG (False / True), for
    a denoiser whose sections read TeaCache's `teacache_signal`."""
    return {name: kind for family in step_families(teacache_signal) for name, kind in family.step_kinds(denoise).items()}


def caching_steps(sections: DenoiserSections, sampler: Sampler) -> dict[str, nn.Module]:
    """The step module of every caching kind, on the family's denoiser sections (no weight copies)."""
    families = step_families(sections.teacache_signal)
    return {name: step for family in families for name, step in family.build_steps(sections, sampler).items()}


def warmup_variants(plan: WorkPlan) -> list[WorkPlan]:
    """Plans of the kinds a request may run in `plan`'s place, chosen by data a warmup run need not
    produce (FBCache's compute / reuse pattern per branch)."""
    return fb_cache_steps.warmup_variants(plan)


def load_state(saved: Any) -> StepCachingState:
    """A caching state from what `StepCachingState.saved` wrote; ValueError names the field."""
    if not isinstance(saved, Mapping) or "settings" not in saved:
        raise ValueError(f"must be a saved caching state (a dict with 'settings'), got {type(saved).__name__}")
    settings = parse_cache_settings(saved["settings"])
    if not isinstance(settings, CacheSettings) or isinstance(settings, NoCache):
        raise ValueError("settings: must name a caching method, not 'none'")
    state_type = settings.state_type
    fields = checked_fields(state_type, {k: v for k, v in saved.items() if k != "settings"}, f"caching ({settings.method})",
                            provided=("settings",))  # fmt: skip
    return state_type(settings=settings, **fields)


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
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"cache.method={method!r} is not a known method; known methods: {', '.join(METHODS)} "
                         f"('{NO_CACHE}' turns caching off)")  # fmt: skip
    try:
        return settings_type(method).model_validate(dict(value))
    except ValidationError as err:
        problems = "; ".join(f"cache.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ValueError(f"cache method {method!r}: {problems}") from None
