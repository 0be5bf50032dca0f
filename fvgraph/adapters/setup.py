"""What an engine is built with for adapters, applied to its loaded components (before any step is built).

    setup = AdapterSetup(loras={"style": "style.safetensors", "fast": "distill.safetensors"},
                         merge={"fast": 1.0}, slots=LoraSlots(max_loras=4))
    registry = apply_adapters(components, card, setup)

Adapters named in `merge` are fused into the weights at their scale (the weights version changes);
the others are loaded into slots, which are installed when any adapter needs one or `slots` is set.
Merging comes first, so FP8 copies (-O3) and every signature see the merged weights.
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
class AdapterSetup:
    loras: dict[str, str | Path] = field(default_factory=dict)  # name -> local LoRA file
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
    """`setup` with the card's distill LoRA (fvgraph/recipe.py RecipeAdapter) fused at the recipe's scale
    (merge_loras may give another). The file itself is the user's to pass: AdapterError, naming where it
    is published, when `loras` lacks it."""
    parents = card.recipe.parents
    adapter = None if parents is None else parents.adapter
    if adapter is None or adapter.in_checkpoint:
        return setup
    if setup is None or adapter.name not in setup.loras:
        raise AdapterError(
            f"card {card.card_id!r} runs recipe {card.recipe.name!r}, a LoRA distill of {parents.base_card!r}: pass the "
            f"LoRA file ({adapter.source}: {adapter.weight_name}) as loras={{{adapter.name!r}: PATH}} (CLI: --lora "
            f"{adapter.name}=PATH)"
        )  # fmt: skip
    return AdapterSetup(setup.loras, {adapter.name: adapter.scale, **setup.merge}, setup.slots)


def apply_adapters(components, pipeline_class: str, setup: AdapterSetup) -> AdapterRegistry:
    """Merge, install slots, load; returns the engine's registry. Changes `components` in place."""
    if components.transformer_2 is not None:
        raise AdapterError("LoRA adapters on a two-expert card (transformer_2) are not supported yet")
    transformer = components.transformer
    registry = AdapterRegistry(None, pipeline_class, transformer)
    for name, scale in setup.merge.items():
        weights = registry.read(name, setup.loras[name])
        components.weights_version += merge_lora(transformer, weights, scale)
        registry.record_merged(name, weights, scale)
    if setup.wants_slots:
        registry.store = install_slots(transformer, setup.slots or LoraSlots())
    for name, path in setup.loras.items():
        if name not in setup.merge:
            registry.load(name, path)
    return registry
