"""The engine's adapters: which LoRA is in which slot, which are merged, and what a request may choose.

    registry = AdapterRegistry(store, pipeline_class="WanPipeline", transformer=components.transformer)
    registry.load("style", "style.safetensors")       # into a free slot, in place
    choice = registry.choose({"style": 0.7})            # a request's: names, scales, digests
    rows = registry.rows(choice, device)                # {"lora_index": [1, K], "lora_scale": [1, K]}
    registry.unload("style")                            # the engine refuses this while a request uses it

On a two-expert card (Wan 2.2 A14B) each expert has slots of its own, and an adapter loads into one
of them by diffusers' component name: `registry.load("low", path, expert="transformer_2")` (without
`expert`, the high-noise `transformer`, as diffusers' `load_lora_weights` without
`load_into_transformer_2`). A request names adapters of either expert in one `loras`; each expert's
steps take the rows of its own adapters only (`rows(choice, device, expert)`).

A request's choice records each adapter's digest; its rows are looked up again at each request's
first denoise step, and a state whose adapter is gone or was replaced (another digest under the
name) is refused naming the adapter: a request never runs half on one adapter and half on another.
Merged adapters (fvgraph/adapters/merge.py) are part of the weights; a request may name them only at
the scale they were merged with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fvgraph.adapters.lora_file import AdapterError, LoraWeights, read_lora
from fvgraph.adapters.names import bad_name
from fvgraph.adapters.slots import SlotStore

EXPERTS = ("transformer", "transformer_2")  # diffusers' names of a two-expert card's denoisers: high, low noise


@dataclass
class AdapterChoice:
    """A request's adapters (its loop state's `adapters` field): name -> scale, and the digest each had."""

    scales: dict[str, float]
    digests: dict[str, str]

    def saved(self) -> dict[str, Any]:
        return {"scales": dict(self.scales), "digests": dict(self.digests)}

    @classmethod
    def load(cls, value: Any) -> AdapterChoice:
        """Read back what `saved()` wrote; ValueError for anything else."""
        if not isinstance(value, dict) or set(value) != {"scales", "digests"}:
            raise ValueError("must be a dict with 'scales' and 'digests'")
        scales, digests = value["scales"], value["digests"]
        if not (isinstance(scales, dict) and all(isinstance(k, str) and isinstance(v, float) for k, v in scales.items())):
            raise ValueError("scales must map adapter names to numbers")
        if not (isinstance(digests, dict) and set(digests) == set(scales) and all(isinstance(v, str) for v in digests.values())):
            raise ValueError("digests must map each adapter name to its digest")
        return cls(dict(scales), dict(digests))


@dataclass
class LoadedAdapter:
    name: str
    weights: LoraWeights
    slot: int | None  # None: merged into the base weights
    scale: float | None = None  # the merged scale (merged adapters only)
    expert: str = "transformer"  # the denoiser it adapts (EXPERTS)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.weights.path, "digest": self.weights.digest, "rank": self.weights.rank,
                "modules": len(self.weights.modules), "slot": self.slot, "merged_scale": self.scale,
                "expert": self.expert}  # fmt: skip


@dataclass
class AdapterRegistry:
    store: SlotStore | None  # None: merged adapters only (no slots installed)
    pipeline_class: str
    transformer: nn.Module
    adapters: dict[str, LoadedAdapter] = field(default_factory=dict)
    transformer_2: nn.Module | None = None  # a two-expert card's low-noise denoiser
    store_2: SlotStore | None = None  # its slots (installed with `store`'s)

    # -- experts ------------------------------------------------------------------------------------

    def expert(self, expert: str | None) -> str:
        """`expert` checked against this engine's denoisers; None is the high-noise (or only) one."""
        if expert is None:
            return EXPERTS[0]
        if expert not in EXPERTS:
            raise AdapterError(f"expert={expert!r} must be 'transformer' (high noise) or 'transformer_2' (low noise), "
                               "diffusers' names of a two-expert card's denoisers")  # fmt: skip
        if self.transformer_2 is None:
            raise AdapterError(f"expert={expert!r}: this card has one denoiser; leave expert unset (adapters load into it)")
        return expert

    def module_of(self, expert: str) -> nn.Module:
        return self.transformer_2 if expert == "transformer_2" else self.transformer

    def store_of(self, expert: str) -> SlotStore | None:
        return self.store_2 if expert == "transformer_2" else self.store

    # -- loading ------------------------------------------------------------------------------------

    def read(self, name: str, path: str | Path, expert: str | None = None) -> LoraWeights:
        """Read and check a file for `expert` (the keys against that denoiser's linears)."""
        return self._read(name, path, self.expert(expert))

    def _read(self, name: str, path: str | Path, expert: str) -> LoraWeights:
        check_name(name)
        if name in self.adapters:
            raise AdapterError(f"lora {name!r} is already loaded (from {self.adapters[name].weights.path}); unload it first")
        if self.transformer_2 is None:
            return read_lora(path, self.pipeline_class, self.transformer)
        try:
            return read_lora(path, self.pipeline_class, self.module_of(expert))
        except AdapterError as err:
            raise AdapterError(f"expert {expert!r}: {err}") from None

    def load(self, name: str, source: str | Path | LoraWeights, expert: str | None = None) -> LoadedAdapter:
        """Read `source` (or take it read already, by `read` on another thread), check it against the
        slots of `expert` (None: the high-noise or only denoiser), and write it into a free slot there."""
        expert = self.expert(expert)
        if self.store is None:
            raise AdapterError("this engine has no adapter slots (it was built with merged adapters only): "
                               "build it with lora_slots to load adapters while serving")  # fmt: skip
        if isinstance(source, LoraWeights):
            check_name(name)
            if name in self.adapters:  # loaded meanwhile under that name
                raise AdapterError(f"lora {name!r} is already loaded (from {self.adapters[name].weights.path}); unload it first")
            weights = source
        else:
            weights = self._read(name, source, expert)
        store = self.store_of(expert)
        store.check(weights)
        free = [i for i, digest in enumerate(store.digests) if digest is None]
        if not free:
            held = ", ".join(sorted(a.name for a in self.adapters.values() if a.slot is not None and a.expert == expert))
            where = f" of {expert}" if self.transformer_2 is not None else ""
            raise AdapterError(f"lora {name!r}: all max_loras={store.slots.max_loras} slots{where} hold adapters ({held}); "
                               "unload one first, or build the engine with more slots")  # fmt: skip
        store.write(free[0], weights)
        self.adapters[name] = LoadedAdapter(name, weights, free[0], expert=expert)
        return self.adapters[name]

    def record_merged(self, name: str, weights: LoraWeights, scale: float, expert: str = "transformer") -> None:
        self.adapters[name] = LoadedAdapter(name, weights, None, scale, expert)

    def unload(self, name: str) -> LoadedAdapter:
        adapter = self.get(name)
        if adapter.slot is None:
            raise AdapterError(f"lora {name!r} is merged into the base weights; it cannot be unloaded (build another engine)")
        self.store_of(adapter.expert).clear(adapter.slot)
        return self.adapters.pop(name)

    def get(self, name: str) -> LoadedAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"unknown lora {name!r}; loaded: {sorted(self.adapters) or 'none'}")
        return adapter

    def describe(self) -> list[dict[str, Any]]:
        return [a.describe() for a in self.adapters.values()]

    # -- what a request chooses ---------------------------------------------------------------------

    def choose(self, loras: dict[str, float] | None) -> AdapterChoice | None:
        """A request's `loras`, checked: every name loaded, at most max_loras_per_request slotted ones
        per expert, a merged one only at its merged scale. None when the request adds nothing to the weights."""
        if not loras:
            return None
        unknown = sorted(set(loras) - set(self.adapters))
        if unknown:
            raise AdapterError(f"unknown lora {', '.join(map(repr, unknown))}; loaded: {sorted(self.adapters) or 'none'}")
        slotted = {}
        for name, scale in loras.items():
            adapter = self.adapters[name]
            if adapter.slot is None:
                if scale != adapter.scale:
                    raise AdapterError(f"lora {name!r} is merged into the weights at scale {adapter.scale}; a request "
                                       f"may name it only at that scale, not {scale}")  # fmt: skip
            elif scale != 0.0:
                slotted[name] = float(scale)
        if not slotted:
            return None
        limit = self.store.slots.max_loras_per_request
        for expert in EXPERTS:  # each expert's steps take the rows of its own adapters
            count = sum(self.adapters[name].expert == expert for name in slotted)
            if count > limit:
                where = f" for {expert}" if self.transformer_2 is not None else ""
                raise AdapterError(f"{count} loras{where} in one request; this engine combines at most max_loras_per_request={limit}")
        return AdapterChoice(slotted, {name: self.adapters[name].weights.digest for name in slotted})

    def rows(self, choice: AdapterChoice | None, device: torch.device, expert: str = "transformer") -> dict[str, torch.Tensor]:
        """The step inputs of `expert`'s steps for a request's choice ({} on an engine without slots):
        the slot indices and scales of the chosen adapters on that expert, [1, K] each, zero scale
        where the request uses fewer than K adapters there."""
        if self.store is None:
            return {}
        k = self.store.slots.max_loras_per_request
        index, scale = [0] * k, [0.0] * k
        names = self.chosen_on(choice, expert)
        slots = [self.current_slot(name, choice.digests[name]) for name in names]  # refuses a gone adapter first
        for j, (name, slot) in enumerate(zip(names, slots)):
            index[j], scale[j] = slot, choice.scales[name]
        return {"lora_index": torch.tensor([index], dtype=torch.long, device=device),
                "lora_scale": torch.tensor([scale], dtype=torch.float32, device=device)}  # fmt: skip

    def chosen_on(self, choice: AdapterChoice | None, expert: str) -> list[str]:
        """The names in `choice` that adapt `expert` (an adapter no longer loaded counts on every
        expert, so that `current_slot` refuses it wherever the request steps next)."""
        if choice is None:
            return []
        return [n for n in choice.scales if n not in self.adapters or self.adapters[n].expert == expert]

    def current_slot(self, name: str, digest: str) -> int:
        """The slot holding adapter `name` with `digest`; AdapterError when it was unloaded or replaced."""
        adapter = self.adapters.get(name)
        if adapter is None or adapter.slot is None:
            raise AdapterError(f"lora {name!r} is not loaded on this engine: load it (the same file) to run this request")
        if adapter.weights.digest != digest:
            raise AdapterError(f"lora {name!r} on this engine has digest {adapter.weights.digest}, the request was "
                               f"started with {digest}: load the adapter it was started with")  # fmt: skip
        return adapter.slot


def check_name(name: str) -> None:
    why = bad_name(name)
    if why is not None:
        raise AdapterError(why)
