"""The loop's side of step caching (fvgraph/caching/ decides), as a part the loop is given at build.

It checks a request's `cache` against the methods the deployment enabled, the card and the
calibration store, starts the request's caching state (the loop state's one `caching` field) when
the request starts, asks that state before each denoise launch which kind runs and with which
inputs, hands it each launch's outputs, and counts FLOPs (the planned step's against the uncached
one's). What is kept, and why, is the method's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from fvgraph.adapters.slots import ROW_INPUTS
from fvgraph.caching.calibration_store import CalibrationStore
from fvgraph.caching.settings import CacheSettings, NoCache, PolicyContext
from fvgraph.caching.state import StepCachingState
from fvgraph.card import ModelCard
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import ShapeSignature, StepResult, WorkPlan
from fvgraph.loops.step_flops import StepFlops, meta_twin
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected

if TYPE_CHECKING:
    from fvgraph.loops.denoise_state import DenoiseFacts, DenoiseState


class StepCaching:
    """One loop's step caching. `refused`: why this loop's requests may not use it (None: they may);
    `denoise_steps(transformer)`: the loop's denoise step modules on any copy of the denoiser (FLOPs)."""

    def __init__(self, card: ModelCard, components: Components, sections: DenoiserSections | None, refused: str | None,
                 methods: tuple[str, ...], calibration: CalibrationStore,
                 denoise_steps: Callable[[nn.Module], dict[str, nn.Module]]):  # fmt: skip
        self.card = card
        self.components = components
        self.sections = sections
        self.refused = refused
        self.methods = methods
        self.calibration = calibration
        self._denoise_steps = denoise_steps
        self._flops: StepFlops | None = None  # built at the first cached request

    def deployed_default(self, request: Request) -> Request:
        """`request` (before resolve) with the card's default caching left off where this deployment did
        not enable its method: a card default is a suggestion the deployment overrides. NoCache, not
        None, so resolving never brings the default back (nor checks the steps it would pin)."""
        default = self.card.default_cache
        if request.cache is None and default is not None and default.method not in self.methods:
            return request.model_copy(update={"cache": NoCache()})
        return request

    def check(self, resolved: Request) -> Request:
        """`resolved` with its calibrated cache settings filled in; RequestRejected naming the field."""
        if resolved.caching is None:
            return resolved
        if self.refused is not None:
            raise RequestRejected("cache", self.refused)
        if resolved.caching.method not in self.methods:
            raise RequestRejected("cache", self._not_enabled(resolved.caching.method))
        try:
            settings = resolved.caching.for_sections(self.sections)
        except ValueError as err:
            field, _, rule = str(err).partition(": ")
            raise RequestRejected(field, rule) from None
        if settings is not resolved.caching:
            resolved = resolved.model_copy(update={"cache": settings})
        if problem := resolved.caching.check_card(self.card):
            raise RequestRejected(*problem)
        if resolved.caching.missing_calibration():
            resolved = resolved.model_copy(update={"cache": self._calibrated(resolved.caching)})
        return resolved

    def _not_enabled(self, method: str) -> str:
        enabled = ", ".join(self.methods) or "none (exact execution only)"
        return (f"step-caching method {method!r} is not enabled on this deployment; enabled: {enabled}; pass "
                "cache='none' for exact execution, or deploy with `--cache-methods` (Engine.from_card(cache_methods=...)) "
                "naming it")  # fmt: skip

    def _calibrated(self, settings: CacheSettings) -> CacheSettings:
        """`settings` with their calibrated fields filled from the store, for these weights."""
        c, method = self.components, settings.method
        record = self.calibration.load(self.card.card_id, c.weights_version, method)
        missing = settings.missing_calibration()
        if record is None:
            raise RequestRejected(f"cache.{missing[0]}", f"not given, and none calibrated for card {self.card.card_id!r} "
                                  f"with weights {c.weights_version} under {self.calibration.root}: run `fvgraph calibrate "
                                  f"--card {self.card.card_id} [--checkpoint P] --steps N` or pass {missing[0]}")  # fmt: skip
        return settings.calibrated(record["values"])

    def _policy_context(self, state: DenoiseState) -> PolicyContext:
        c = self.components
        return PolicyContext(state.timesteps, c.transformer, c.transformer.dtype, self.card, self.sections)

    def start(self, state: DenoiseState, request: Request) -> None:
        # The policy is built here, before any step is queued: one that plans from the denoiser
        # (TeaCache runs its condition embedder on the timesteps) reads the device only now.
        if request.caching is not None:
            state.caching = request.caching.start(self._policy_context(state))

    def plan(self, state: DenoiseState, facts: DenoiseFacts, inputs: dict[str, torch.Tensor],
             signatures: dict[ShapeSignature, ShapeSignature], places: int | None = None) -> WorkPlan:  # fmt: skip
        """The launch the request's caching state decides on; its FLOPs and the uncached step's.
        `places`: the adapter places its rows use (WorkPlan.adapter_places)."""
        caching: StepCachingState = state.caching
        if caching.policy is None:  # a resumed state: its policy is rebuilt on this engine
            caching.bind(self._policy_context(state))
        plain = dict(inputs)  # the uncached step's inputs, for its FLOPs
        kind, inputs = caching.plan(state.cfg, state.step_index, inputs)
        if self._flops is None:  # the denoise steps on a data-free twin of the denoiser
            self._flops = StepFlops(self._denoise_steps(meta_twin(self.components.transformer)))
        # The twin has no adapter slots: the base steps' FLOPs, without the rows' adapters.
        caching.flops = (self._flops.count(kind, _without_rows(inputs)), self._flops.count(facts.kind, _without_rows(plain)))
        plan = WorkPlan(state.request_id, kind, inputs, state.step_index, facts.pixels, adapter_places=places)
        plan.signature = signatures.setdefault(plan.signature, plan.signature)
        return plan

    def advance(self, state: DenoiseState, result: StepResult) -> bool:
        """Hand the launch's outputs to the caching state; False when the step has a launch still to run."""
        caching: StepCachingState = state.caching
        ran, uncached = caching.flops or (0, 0)
        caching.counts["flops"] = caching.counts.get("flops", 0) + ran
        whole = caching.advance(state.cfg, state.step_index, result)
        if whole:  # the uncached step counts once per step, not per launch
            caching.counts["flops_uncached"] = caching.counts.get("flops_uncached", 0) + uncached
        return whole


def _without_rows(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in inputs.items() if name not in ROW_INPUTS}
