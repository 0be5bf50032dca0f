"""The loop registry: a card's `recipe.assumes_loop` id -> the class that runs it.

Entries are import paths, imported on first use, so the registry (and the runtime that reads it)
imports no loop module. Each names a DenoiseLoop composed of one family's parts (docs/loops.md); adding
a family is its parts' file, one line here, and a card naming its id.
"""

from __future__ import annotations

import importlib

from fvgraph.card import ModelCard
from fvgraph.models.components import Components
from fvgraph.contract.loop import Loop
from fvgraph.loops.loop_parts import LoopConfig
from fvgraph.torchvision_notes import drop_torchvision_fallback_notes

LOOPS: dict[str, str] = {
    "t2v": "fvgraph.loops.t2v_loop:TextToVideoLoop",
    "i2v": "fvgraph.loops.i2v_loop:ImageToVideoLoop",
    "t2v_two_expert": "fvgraph.loops.expert_loop:TwoExpertTextToVideoLoop",
    "i2v_two_expert": "fvgraph.loops.expert_loop:TwoExpertImageToVideoLoop",
    "ti2v": "fvgraph.loops.ti2v_loop:TextImageToVideoLoop",
    "flux": "fvgraph.loops.flux_loop:FluxLoop",
    "flux_kontext": "fvgraph.loops.flux_kontext_loop:FluxKontextLoop",
    "qwen_image": "fvgraph.loops.qwen_image_loop:QwenImageLoop",
    "qwen_image_edit": "fvgraph.loops.qwen_image_edit_loop:QwenImageEditLoop",
    "hunyuan_video15_t2v": "fvgraph.loops.hunyuan_video15_loop:HunyuanVideo15Loop",
    "hunyuan_video15_i2v": "fvgraph.loops.hunyuan_video15_i2v_loop:HunyuanVideo15ImageToVideoLoop",
}


def loop_class(loop_id: str) -> type:
    path = LOOPS.get(loop_id)
    if path is None:
        raise ValueError(f"loop {loop_id!r} is not registered; known loops: {', '.join(sorted(LOOPS))} (fvgraph/loops/registry.py)")
    module, _, name = path.partition(":")
    drop_torchvision_fallback_notes()  # the family's module may import a pipeline's image processor classes
    return getattr(importlib.import_module(module), name)


def build_loop(card: ModelCard, components: Components, config: LoopConfig | None = None) -> Loop:
    """The loop the card's recipe assumes, bound to the loaded components and built complete with the
    deployment's `config` (step-caching methods and calibration, adapters, run facts)."""
    return loop_class(card.recipe.assumes_loop)(card, components, config)
