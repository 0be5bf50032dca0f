"""The loop's side of LoRA adapters (fvgraph/adapters/ holds them), as a part the loop is given at build.

It checks a request's `loras` against the engine's adapters, records the choice (the loop state's one
`adapters` field), gives each denoise step (a step-caching one too) the request's slot rows, and refuses to resume a
state whose adapters this engine does not hold with the same digests. On a two-expert card a step's
rows are those of the adapters loaded into the expert its kind runs (StepKind.component), so each
adapter applies on its own expert's steps only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.registry import AdapterChoice, AdapterRegistry
from fvgraph.request import Request, RequestRejected

if TYPE_CHECKING:
    from fvgraph.loops.denoise_state import DenoiseState


class LoopAdapters:
    """`registry`: the engine's adapters (None: an engine without adapters)."""

    def __init__(self, registry: AdapterRegistry | None, device: torch.device):
        self.registry = registry
        self.device = device

    def choice(self, request: Request) -> AdapterChoice | None:
        """The request's `loras` checked against the engine's adapters (RequestRejected naming `loras`)."""
        if not request.loras:
            return None
        if self.registry is None:
            raise RequestRejected("loras", f"this engine serves no LoRA adapters (asked for {sorted(request.loras)}): "
                                           "load them with --lora NAME=PATH or Engine.from_card(loras=...)")  # fmt: skip
        try:
            choice = self.registry.choose(request.loras)
        except AdapterError as err:
            raise RequestRejected("loras", str(err)) from None
        return choice

    def rows(self, state: DenoiseState, expert: str = "transformer") -> dict[str, torch.Tensor]:
        """The request's adapter rows for `expert`'s steps on an engine with slots: every denoise step takes
        them, cached or not (zero scales for a request without adapters), so requests with any adapters
        share one graph."""
        if self.registry is None or self.registry.store is None:
            return {}
        try:
            return self.registry.rows(state.adapters, self.device, expert)
        except AdapterError as err:  # unloaded or replaced since the request started (Engine.step by hand)
            raise RequestRejected("loras", f"request {state.request_id}: {err}") from None

    def places(self, state: DenoiseState, expert: str = "transformer") -> int | None:
        """How many places of its adapter rows the request uses on `expert`'s steps (WorkPlan.adapter_places);
        None on an engine without slots, whose steps take no rows."""
        if self.registry is None or self.registry.store is None:
            return None
        return len(self.registry.chosen_on(state.adapters, expert))

    def merged(self) -> dict[str, float]:
        """The adapters fused into the weights (a recipe's), by scale: every request runs them."""
        return {} if self.registry is None else {a.name: a.scale for a in self.registry.adapters.values() if a.slot is None}

    def check_saved(self, state: DenoiseState) -> None:
        """A state started with adapters resumes only where the same adapters (by digest) are loaded."""
        if state.adapters is None:
            return
        if self.registry is None or self.registry.store is None:
            raise ValueError(f"adapters: request {state.request_id} runs with loras {sorted(state.adapters.scales)}; "
                             "this engine has no adapter slots")  # fmt: skip
        for name, digest in state.adapters.digests.items():
            try:
                self.registry.current_slot(name, digest)
            except AdapterError as err:
                raise ValueError(f"adapters: request {state.request_id}: {err}") from None
