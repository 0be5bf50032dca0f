"""What an engine is built with for adapters, applied to its loaded components (before any step is built).

    setup = AdapterSetup(loras={"style": "style.safetensors", "fast": "distill.safetensors",
                                "low": LoraFile("low.safetensors", expert="transformer_2")},
                         merge={"fast": 1.0}, slots=LoraSlots(max_loras=4))
    registry = apply_adapters(components, card, setup)

Adapters named in `merge` are fused into the weights at their scale (the weights version changes);
the others are loaded into slots, which are installed when any adapter needs one or `slots` is set
(on a two-expert card, on both experts). A plain path loads into the high-noise (or only) denoiser,
a LoraFile into the expert it names. Merging comes first, so FP8 copies (-O3) and every signature
see the merged weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.merge import merge_lora
from fvgraph.adapters.registry import AdapterRegistry, check_name
from fvgraph.adapters.slots import LoraSlots, install_slots


@dataclass(frozen=True)
class LoraFile:
    """A local LoRA file for one expert of a two-expert card (diffusers' names: 'transformer' for high
    noise, 'transformer_2' for low noise; None: 'transformer', as diffusers' load_lora_weights)."""

    path: str | Path
    expert: str | None = None


def lora_source(value: str | Path | LoraFile) -> tuple[str | Path, str | None]:
    """(path, expert) of a `loras` value."""
    return (value.path, value.expert) if isinstance(value, LoraFile) else (value, None)


@dataclass(frozen=True)
class AdapterSetup:
    loras: dict[str, str | Path | LoraFile] = field(default_factory=dict)  # name -> local LoRA file
    merge: dict[str, float] = field(default_factory=dict)  # names of `loras` fused into the weights, at these scales
    slots: LoraSlots | None = None  # None: default slots when an unmerged adapter needs them

    def __post_init__(self) -> None:
        for name in (*self.loras, *self.merge):
            check_name(name)
        unknown = sorted(set(self.merge) - set(self.loras))
        if unknown:
            raise AdapterError(f"merge_loras names {unknown}, which loras does not load: pass each as NAME=PATH too")

    @property
    def wants_slots(self) -> bool:
        return self.slots is not None or any(name not in self.merge for name in self.loras)


def engine_adapter_setup(card, loras: dict | None, merge_loras: dict | None, slots: LoraSlots | None) -> AdapterSetup | None:
    """What Engine.from_card's `loras`, `merge_loras` and `lora_slots` ask for, with the card's recipe adapter."""
    for name, scale in (merge_loras or {}).items():  # fused into the weights: NaN there fails every request
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or abs(scale) > 100:
            raise AdapterError(f"merge_loras[{name!r}]={scale!r} must be a finite number in [-100, 100]")
    setup = AdapterSetup(dict(loras or {}), dict(merge_loras or {}), slots) if loras or slots else None
    return with_recipe_adapter(card, setup)


def with_recipe_adapter(card, setup: AdapterSetup | None) -> AdapterSetup | None:
    """`setup` with the card's distill LoRAs (fvgraph/recipe.py RecipeAdapter; a two-expert distill has
    one per expert) each fused into its expert at the recipe's scale (merge_loras may give another).
    The files are the user's to pass, each as its file or a folder holding it under its published
    name: AdapterError, naming where it is published, when `loras` lacks one."""
    parents = card.recipe.parents
    wanted = [] if parents is None else [(a, e) for a, e in ((parents.adapter, None), (parents.adapter_2, "transformer_2"))
                                          if a is not None and not a.in_checkpoint]  # fmt: skip
    for adapter, expert in wanted:
        if setup is None or adapter.name not in setup.loras:
            raise AdapterError(
                f"card {card.card_id!r} runs recipe {card.recipe.name!r}, a LoRA distill of {parents.base_card!r}: pass the "
                f"LoRA file ({adapter.source}: {adapter.weight_name}) as loras={{{adapter.name!r}: PATH}} (CLI: --lora "
                f"{adapter.name}=PATH; PATH may be the folder holding it)"
            )  # fmt: skip
        path, given = lora_source(setup.loras[adapter.name])
        if given not in (None, expert or "transformer"):
            raise AdapterError(f"lora {adapter.name!r}: expert={given!r}, but recipe {card.recipe.name!r} loads it into "
                               f"{expert or 'transformer'}: leave its expert unset")  # fmt: skip
        if Path(path).is_dir():  # a local copy of the published folder
            path = Path(path) / adapter.weight_name
        loras = {**setup.loras, adapter.name: LoraFile(path, expert)}
        setup = AdapterSetup(loras, {adapter.name: adapter.scale, **setup.merge}, setup.slots)
    return setup


def apply_adapters(components, pipeline_class: str, setup: AdapterSetup) -> AdapterRegistry:
    """Merge, install slots, load; returns the engine's registry. Changes `components` in place.
    Every file is read and checked before any is merged, so a bad one leaves the weights untouched."""
    registry = AdapterRegistry(None, pipeline_class, components.transformer, transformer_2=components.transformer_2)
    merged = []
    for name, scale in setup.merge.items():
        path, expert = lora_source(setup.loras[name])
        merged.append((name, registry.read(name, path, expert), scale, registry.expert(expert)))
    for name, weights, scale, expert in merged:
        components.weights_version += merge_lora(registry.module_of(expert), weights, scale)
        registry.record_merged(name, weights, scale, expert)
    if setup.wants_slots:
        registry.store = install_slots(components.transformer, setup.slots or LoraSlots())
        if components.transformer_2 is not None:
            registry.store_2 = install_slots(components.transformer_2, setup.slots or LoraSlots())
    for name, value in setup.loras.items():
        if name not in setup.merge:
            registry.load(name, *lora_source(value))
    return registry
