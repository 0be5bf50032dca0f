"""Loading and unloading LoRA adapters on a running engine (the Engine's adapter methods).

    engine.load_lora("style", "style.safetensors")   # into a free slot: nothing recompiles
    engine.generate([Request(prompt="...", loras={"style": 0.7})])
    engine.unload_lora("style")                        # refused while a request in flight uses it

A load or unload happens between ticks, never inside one (a step reads the slots while it runs).
Unloading drops exactly the eager projection-cache entries computed with that adapter; compiled
steps hoist per request, and no request that uses an adapter is in flight when it goes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.registry import AdapterRegistry


class AdapterAdmin:
    adapters: AdapterRegistry | None

    def loras(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, path, digest, rank, adapted modules, slot (None: merged)."""
        return [] if self.adapters is None else self.adapters.describe()

    def load_lora(self, name: str, path: str | Path) -> dict[str, Any]:
        """Read a local LoRA file (any format diffusers converts for this family) into a free slot.
        AdapterError names the key or rule when the file does not fit the engine's slots."""
        self._between_ticks("load_lora")
        if self.adapters is None or self.adapters.store is None:
            raise AdapterError("this engine has no adapter slots: build it with lora_slots (or --max-loras) to load adapters")
        return self.adapters.load(name, path).describe()

    def unload_lora(self, name: str) -> dict[str, Any]:
        """Free `name`'s slot. Refused while a submitted request that chose it has not ended."""
        self._between_ticks("unload_lora")
        if self.adapters is None:
            raise AdapterError(f"unknown lora {name!r}: this engine has no adapters")
        self.adapters.get(name)  # an unknown name is refused naming it
        users = sorted(s.request_id for s in self._live_states()
                       if getattr(s, "adapters", None) is not None and name in s.adapters.scales)  # fmt: skip
        if users:
            raise AdapterError(f"lora {name!r} is in use by {len(users)} request(s) in flight ({', '.join(users[:5])}); "
                               "unload it after they end, or cancel them")  # fmt: skip
        adapter = self.adapters.unload(name)
        if self.projection_cache is not None:
            digest = adapter.weights.digest
            self.projection_cache.drop_variants(lambda rows: any(d == digest for row in rows for d, _ in row))
        return adapter.describe()

    def _between_ticks(self, what: str) -> None:
        if self._running_steps:
            raise RuntimeError(f"Engine.{what}() was called from inside a callback of a running tick: "
                               "adapters change between ticks, after the callback returns")  # fmt: skip
        self.drain()  # a batch running ahead reads the slots it was launched with

    def _live_states(self) -> list:
        return [*self._scheduler.waiting, *self._scheduler.running]
