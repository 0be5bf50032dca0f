"""Loading and unloading LoRA adapters on a running engine (the Engine's adapter methods delegate here).

    engine.load_lora("style", "style.safetensors")   # into a free slot: nothing recompiles
    engine.load_lora("low", "low.safetensors", expert="transformer_2")   # a two-expert card's low-noise expert
    engine.generate([Request(prompt="...", loras={"style": 0.7})])
    engine.unload_lora("style")                        # refused while a request in flight uses it

A load or unload happens between ticks, never inside one (a step reads the slots while it runs), and on
a parallel engine on every rank or on none (fvgraph/parallel/rank_adapters.py).
Unloading drops exactly the eager projection-cache entries computed with that adapter; compiled
steps hoist per request, and no request that uses an adapter is in flight when it goes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fvgraph.adapters.lora_file import AdapterError, LoraWeights
from fvgraph.adapters.registry import AdapterRegistry
from fvgraph.contract.loop import LoopState
from fvgraph.parallel.rank_adapters import RankAdapters
from fvgraph.runtime.projection_cache import ExactProjectionCache


class AdapterAdmin:
    """Handed the engine's adapters and eager projection cache (either may be None), and three engine
    calls: `live_states` (the requests submitted and not ended), `refuse_in_tick(what, instead)`
    (raises when called from a callback of a running tick) and `drain` (settles a batch running ahead)."""

    def __init__(self, adapters: AdapterRegistry | None, projection_cache: ExactProjectionCache | None,
                 live_states: Callable[[], list[LoopState]], refuse_in_tick: Callable[[str, str], None],
                 drain: Callable[[], None], ranks: RankAdapters | None = None):  # fmt: skip
        self._adapters, self._projection_cache = adapters, projection_cache
        self.ranks = ranks  # a parallel engine's worker ranks, which load and unload with this one
        self._live_states, self._refuse_in_tick, self._drain = live_states, refuse_in_tick, drain

    def loras(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, path, digest, rank, adapted modules, slot (None: merged)."""
        return [] if self._adapters is None else self._adapters.describe()

    def read_lora(self, name: str, path: str | Path, expert: str | None = None) -> LoraWeights:
        """Read and check a local LoRA file for `name` (on `expert`) without loading it: touches no engine
        state, so a server runs it on a worker thread and hands the result to `load_lora`."""
        if self._adapters is None or self._adapters.store is None:
            raise AdapterError("this engine has no adapter slots: build it with lora_slots (or --max-loras) to load adapters")
        weights = self._adapters.read(name, path, expert)
        self._adapters.store_of(self._adapters.expert(expert)).check(weights)
        return weights

    def load_lora(self, name: str, source: str | Path | LoraWeights, expert: str | None = None) -> dict[str, Any]:
        """Read a local LoRA file (any format diffusers converts for this family; or take what
        `read_lora` read) into a free slot of `expert` (a two-expert card's 'transformer' or
        'transformer_2'; None: 'transformer'). AdapterError names the key or rule when it does not fit."""
        self._between_ticks("load_lora")
        if self._adapters is None or self._adapters.store is None:
            raise AdapterError("this engine has no adapter slots: build it with lora_slots (or --max-loras) to load adapters")
        if self.ranks is not None and expert not in (None, "transformer"):  # the workers write one expert's slots
            raise AdapterError(f"lora {name!r}: expert={expert!r}: a parallel engine loads adapters into 'transformer' only")
        loaded = self._adapters.load(name, source, expert)
        if self.ranks is not None:  # all or nothing: a worker's refusal unloads it here too
            self.ranks.load(self._adapters, loaded)
        return loaded.describe()

    def unload_lora(self, name: str) -> dict[str, Any]:
        """Free `name`'s slot. Refused while a submitted request that chose it has not ended."""
        self._between_ticks("unload_lora")
        if self._adapters is None:
            raise AdapterError(f"unknown lora {name!r}: this engine has no adapters")
        self._adapters.get(name)  # an unknown name is refused naming it
        users = sorted(s.request_id for s in self._live_states()
                       if s.adapters is not None and name in s.adapters.scales)  # every DenoiseState has the field  # fmt: skip
        if users:
            raise AdapterError(f"lora {name!r} is in use by {len(users)} request(s) in flight ({', '.join(users[:5])}); "
                               "unload it after they end, or cancel them")  # fmt: skip
        if self.ranks is not None:  # the workers first: a refusal there leaves it loaded everywhere
            self.ranks.unload(self._adapters.get(name))
        adapter = self._adapters.unload(name)
        if self._projection_cache is not None:
            digest = adapter.weights.digest
            self._projection_cache.drop_variants(lambda rows: any(d == digest for row in rows for d, _ in row))
        return adapter.describe()

    def _between_ticks(self, what: str) -> None:
        self._refuse_in_tick(what, "adapters change between ticks, after the callback returns")
        self._drain()  # a batch running ahead reads the slots it was launched with
