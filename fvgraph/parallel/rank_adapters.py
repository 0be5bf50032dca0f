"""LoRA adapters on every rank of a parallel engine: each rank holds the same adapters in the same slots.

    ranks = RankAdapters(group)               # rank 0's handle on the worker ranks' adapters
    loaded = registry.load("style", path)      # rank 0 reads the file, checks it and picks the slot
    ranks.load(registry, loaded)               # the same weights into the same slot on every worker

Every rank installs the same slots when it is built, and loads the engine's `loras` files itself.
A request's rows (`lora_index`, `lora_scale`) are chosen on rank 0 and reach the workers inside the
plans, so each worker must hold every adapter in rank 0's slot: rank 0 sends the weights it read
(CPU tensors through the workers' pipes) and the slot number, and each worker checks them against
its own slots and writes them there.

Loads and unloads run between ticks (fvgraph/engine/adapter_admin.py), when no rank runs a step,
and they are all or nothing. A file rank 0 refuses (a bad key, a rank past `max_lora_rank`) is
never sent. A worker that refuses the weights (the slot taken on that rank, a check failing there)
makes every rank that took them drop them again, rank 0 included, and the AdapterError names the
rank and its reason; an unload a worker refuses is undone on the workers that made it, and rank 0
keeps the adapter.
"""

from __future__ import annotations

from typing import Any

from fvgraph.adapters.lora_file import AdapterError, LoraWeights
from fvgraph.adapters.registry import AdapterRegistry, LoadedAdapter
from fvgraph.parallel.workers import WorkerGroup

MESSAGE = "adapters"  # the first item of an adapter message to a worker (its steps' messages are "run")


class RankAdapters:
    """Rank 0's side: each load and unload applied on every worker rank, or on none."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def load(self, registry: AdapterRegistry, loaded: LoadedAdapter) -> None:
        """`loaded` (just loaded on rank 0) into the same slot on every worker; on a refusal, unloaded
        from every rank that took it, rank 0 included, and AdapterError naming the refusing rank."""
        name = loaded.name
        answers = self.group.ask((MESSAGE, "load", name, loaded.weights, loaded.slot), f"load_lora({name!r})")
        refused = {rank: answer[1] for rank, answer in answers.items() if answer[0] != "ok"}
        if not refused:
            return
        took = [rank for rank in answers if rank not in refused]
        if took:
            self.group.ask((MESSAGE, "unload", name), f"undoing load_lora({name!r})", took)
        registry.unload(name)
        rank, why = min(refused.items())
        raise AdapterError(f"lora {name!r}: worker rank {rank} refused it ({why}); no rank loaded it")

    def unload(self, adapter: LoadedAdapter) -> None:
        """Free `adapter`'s slot on every worker (rank 0's own comes after); on a refusal, loaded again
        where it was freed, and AdapterError naming the refusing rank (rank 0 keeps it)."""
        name = adapter.name
        answers = self.group.ask((MESSAGE, "unload", name), f"unload_lora({name!r})")
        refused = {rank: answer[1] for rank, answer in answers.items() if answer[0] != "ok"}
        if not refused:
            return
        freed = [rank for rank in answers if rank not in refused]
        if freed:
            self.group.ask((MESSAGE, "load", name, adapter.weights, adapter.slot), f"undoing unload_lora({name!r})", freed)
        rank, why = min(refused.items())
        raise AdapterError(f"lora {name!r}: worker rank {rank} could not unload it ({why}); it stays loaded on every rank")

    def loaded(self) -> dict[int, list[dict[str, Any]]]:
        """Each worker rank's adapters, as `AdapterRegistry.describe()` gives rank 0's."""
        answers = self.group.ask((MESSAGE, "describe"), "describing the adapters")
        refused = {rank: answer[1] for rank, answer in answers.items() if answer[0] != "ok"}
        if refused:
            rank, why = min(refused.items())
            raise AdapterError(f"worker rank {rank} cannot describe its adapters: {why}")
        return {rank: answer[1] for rank, answer in answers.items()}


def answer(registry: AdapterRegistry | None, op: str, *args) -> tuple:
    """A worker's side: apply one adapter message to this rank's registry; ("ok", value) or ("error", why)."""
    try:
        if registry is None or registry.store is None:
            raise AdapterError("this rank has no adapter slots")
        if op == "describe":
            return "ok", registry.describe()
        if op == "unload":
            registry.unload(*args)
            return "ok", None
        if op == "load":
            load_into_slot(registry, *args)
            return "ok", None
        raise ValueError(f"unknown adapter operation {op!r}")
    except Exception as err:  # the rank's reason goes back to rank 0, which names the rank
        return "error", f"{type(err).__name__}: {err}"


def load_into_slot(registry: AdapterRegistry, name: str, weights: LoraWeights, slot: int) -> None:
    """`weights` into `slot` of this rank (the slot rank 0 chose), checked against this rank's slots."""
    if name in registry.adapters:
        raise AdapterError(f"lora {name!r} is already loaded on this rank (slot {registry.adapters[name].slot})")
    registry.store.check(weights)
    if registry.store.digests[slot] is not None:
        holder = next((a.name for a in registry.adapters.values() if a.slot == slot), "an adapter")
        raise AdapterError(f"lora {name!r}: slot {slot} (rank 0's choice) holds {holder!r} on this rank")
    registry.store.write(slot, weights)
    registry.adapters[name] = LoadedAdapter(name, weights, slot)
