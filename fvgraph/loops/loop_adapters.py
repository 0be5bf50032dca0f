"""The loop's side of LoRA adapters (fvgraph/adapters/ holds them): a mixin for the Wan loops.

It checks a request's `loras` against the engine's adapters, records the choice (the loop state's one
`adapters` field), gives each plain denoise step the request's slot rows, and refuses to resume a
state whose adapters this engine does not hold with the same digests.
"""

from __future__ import annotations

import torch

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.registry import AdapterChoice, AdapterRegistry
from fvgraph.request import Request, RequestRejected


class LoopAdapters:
    """Reads the loop's `adapters` (None: an engine without adapters) and `components`."""

    adapters: AdapterRegistry | None

    def _adapter_choice(self, request: Request) -> AdapterChoice | None:
        """The request's `loras` checked against the engine's adapters (RequestRejected naming `loras`)."""
        if not request.loras:
            return None
        if self.adapters is None:
            raise RequestRejected("loras", f"this engine serves no LoRA adapters (asked for {sorted(request.loras)}): "
                                           "load them with --lora NAME=PATH or Engine.from_card(loras=...)")  # fmt: skip
        try:
            choice = self.adapters.choose(request.loras)
        except AdapterError as err:
            raise RequestRejected("loras", str(err)) from None
        if choice is not None and request.caching is not None:
            raise RequestRejected("loras", f"step caching ({request.caching.method}) does not run with adapter slots yet: "
                                           "send the request without `cache`, or serve the adapter merged")  # fmt: skip
        return choice

    def _adapter_rows(self, state) -> dict[str, torch.Tensor]:
        """The request's adapter rows on an engine with slots: every plain denoise step takes them (zero
        scales for a request without adapters), so requests with any adapters share one graph. A cached
        request runs without adapters (check_request) and its steps take no rows."""
        if self.adapters is None or self.adapters.store is None or state.caching is not None:
            return {}
        try:
            return self.adapters.rows(state.adapters, self.components.device)
        except AdapterError as err:  # unloaded or replaced since the request started (Engine.step by hand)
            raise RequestRejected("loras", f"request {state.request_id}: {err}") from None

    def _check_saved_adapters(self, state) -> None:
        """A state started with adapters resumes only where the same adapters (by digest) are loaded."""
        if state.adapters is None:
            return
        if self.adapters is None or self.adapters.store is None:
            raise ValueError(f"adapters: request {state.request_id} runs with loras {sorted(state.adapters.scales)}; "
                             "this engine has no adapter slots")  # fmt: skip
        for name, digest in state.adapters.digests.items():
            try:
                self.adapters.current_slot(name, digest)
            except AdapterError as err:
                raise ValueError(f"adapters: request {state.request_id}: {err}") from None
