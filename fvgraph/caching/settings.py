"""Step caching settings: the base every method's settings derive from, and the `cache` text form.

A request picks a method with `Request(cache={"method": "magcache", ...})`. The method never runs
inside a step: before each denoise launch the loop asks the request's caching state (its loop
state's `caching` field, fvgraph/caching/state.py) which step kind runs, and the state's policy
decides, from host arithmetic on its accumulators or (FBCache) from one small output of the step's
first launch that the runtime copies to the host for the whole group at once. Every kind a method
adds is an ordinary step kind, compiled (and at -O2 graphed) under its own signature, so a decision
costs no graph break and no host sync: requests that compute and requests that reuse run as
separate groups of one tick.

A method's settings (a `CacheSettings`, with diffusers' field names where diffusers has the method)
name the state type they start (`state_type`) and build the request's policy:

    start() -> memo                                          the accumulators before the first step
    decide(memo, step_index, has_kept) -> (compute, memo)   pure: the same arguments give the same answer

A policy whose schedule is known ahead reads no tensor between steps: MagCache's follows from its
settings; TeaCache's from the request's timesteps and the denoiser's condition embedder, which the
loop hands over in a PolicyContext. A data-dependent policy (FBCache; TeaCache on FLUX) decides
instead from what a step's first launch measured (`decide_branches`), between the two launches its
state runs each step as.

The same settings are spelled three ways: a dict (`{"method": "magcache", "threshold": 0.1}`), the
text `METHOD[:k=v,...]` (`magcache:threshold=0.1`, each value read as JSON, else as a string: what
`--cache` and an HTTP form take), or the word `none`, which turns caching off where a card default
would otherwise apply (`NoCache`). Settings a method calibrates per model (MagCache's `mag_ratios`)
may be left out; `calibrated()` fills them from what `fvgraph calibrate` stored for the loaded
weights (fvgraph/caching/calibration_store.py). The methods are listed in fvgraph/caching/methods.py.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

@dataclass(frozen=True)
class PolicyContext:
    """What the loop knows of a request when it builds the request's policy (when the request is
    initialised, and again after a resume), for methods that plan from more than the step count."""

    timesteps: torch.Tensor  # [N] the request's timesteps, as the scheduler emits them
    transformer: nn.Module  # the denoiser, on the engine's device
    embed_dtype: torch.dtype  # the dtype the text embeddings enter the denoiser in
    card: Any  # the ModelCard (fvgraph/card.py imports this module for its default_cache)
    sections: Any = None  # the denoiser's sections (fvgraph/contract/denoiser_sections.py), on the engine's device


class CachePolicy(Protocol):
    """One request's caching policy, built from its settings and step count (host-side only)."""

    def start(self) -> dict[str, float]: ...

    def decide(self, memo: dict[str, float], step_index: int, has_kept: bool) -> tuple[bool, dict[str, float]]: ...


class ScheduledPolicy:
    """Base of the policies decided by host arithmetic alone (CachePolicy): their whole schedule can be
    worked out ahead."""

    def schedule(self, num_inference_steps: int) -> list[bool]:
        """Which steps compute (something is kept once a step computed)."""
        memo, plan = self.start(), []
        for i in range(num_inference_steps):
            compute, memo = self.decide(memo, i, has_kept=i > 0)
            plan.append(compute)
        return plan


class BranchPolicy(Protocol):
    """A policy decided from the step's own data: what the first launch measured (on the host,
    [branches, ...] per request); the answer is one decision per CFG branch."""

    def start(self) -> dict[str, float]: ...

    def decide_branches(self, memo: dict[str, float], step_index: int, change: torch.Tensor,
                        has_kept: bool) -> tuple[tuple[bool, ...], dict[str, float]]: ...  # fmt: skip


class CacheSettings(BaseModel):
    """Base of every method's settings: frozen, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    state_type: ClassVar[type]  # the StepCachingState a request with these settings carries
    memo_keys: ClassVar[tuple[str, ...]] = ()  # the accumulators its policy keeps

    def start(self, context: PolicyContext) -> Any:
        """The caching state of a request that starts with these settings: its policy built, its
        accumulators at their start."""
        state = self.state_type(settings=self)
        state.memo = state.bind(context).start()
        return state

    @abstractmethod
    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> CachePolicy | BranchPolicy:
        """The request's decisions, built once per request on the host (each method's file)."""

    def check_steps(self, num_inference_steps: int) -> tuple[str, str] | None:
        """(field, message) when these settings cannot serve a request of that many steps, else None."""
        return None

    def for_sections(self, sections: Any) -> CacheSettings:
        """These settings with what they take from the denoiser family's sections filled in
        (DenoiserSections; TeaCache's signal); ValueError naming the field when they cannot run there."""
        return self

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

    @classmethod
    def calibration(cls) -> Calibration | None:
        """How `fvgraph calibrate` measures this method's calibrated fields; None: it has none."""
        return None


class Calibration(Protocol):
    """Measures a method's calibrated fields from one uncached run's full steps."""

    def settings(self) -> CacheSettings:
        """Settings under which every step computes and keeps what the measurement reads."""
        ...

    def reads(self, kind: str) -> bool:
        """Whether the outputs of a step of this kind are what `observe` measures."""
        ...

    def observe(self, step_index: int, outputs: Mapping[str, Any]) -> None: ...

    def values(self) -> dict[str, Any]:
        """The calibrated fields, by name, as the settings take them."""
        ...


class NoCache(CacheSettings):
    """Caching off: what `cache="none"` means, also where the card names a default."""

    method: Literal["none"] = "none"

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> CachePolicy:
        # Request.caching is None for these settings, so no loop asks; a caller that does is told why.
        raise ValueError('cache="none" turns step caching off: it has no policy')


NO_CACHE = "none"


def parse_cache_text(text: str) -> dict[str, Any]:
    """`METHOD[:k=v,...]` (or a JSON object) as a settings dict; `none` as {"method": "none"}. A value
    is read as JSON (numbers, booleans, [lists]) and otherwise kept as a string; commas inside
    brackets belong to the value. ValueError names what is malformed."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as err:  # RecursionError: nested past the parser's depth
            raise ValueError(f"cache={text[:64]!r} is not a JSON object: {err}") from None
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
        except RecursionError:
            raise ValueError(f"cache: {name.strip()[:64]!r} is nested past the JSON parser's depth") from None
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
