"""The HunyuanVideo-1.5 card a loop runs: the card with what the weights' folder says of its recipe.

A HunyuanVideo15Pipeline folder carries its scheduler (scheduler/scheduler_config.json: the flow
`shift`), its guider (guider/guider_config.json: ClassifierFreeGuidance's `guidance_scale`) and its
transformer's `target_size` (the pixel area the pipeline's default 16:9 size is bucketed from). The
loop runs those, as HunyuanVideo15Pipeline.from_pretrained would; the card's values stand where the
folder says nothing (and for the embedded card, whose seeded transformer config gives its target size).
A guider the loop cannot run as a plain uncond + scale * (cond - uncond) (rescaled, the original
formulation, or guidance on part of the steps only) is refused when the loop is built, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

from fvgraph.card import ModelCard, SamplerSpec
from fvgraph.models.components import CheckpointError, Components

DEFAULT_ASPECT = (16, 9)  # HunyuanVideo15Pipeline.default_aspect_ratio (width, height)
# ClassifierFreeGuidance's settings the combine here takes as they are by default (diffusers 0.42.1).
PLAIN_GUIDER = {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0, "enabled": True}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not readable JSON ({type(err).__name__}: {err})") from err


def _guidance_scale(folder: Path, default: float) -> float:
    path = folder / "guider" / "guider_config.json"
    config = _read(path)
    for key, plain in PLAIN_GUIDER.items():
        if config.get(key, plain) != plain:
            raise CheckpointError(f"{path}: {key}={config[key]!r}; the HunyuanVideo-1.5 loop runs ClassifierFreeGuidance "
                                  f"with {key}={plain!r} only")  # fmt: skip
    return float(config.get("guidance_scale", default))


def _scheduler_config(folder: Path, default: dict) -> dict:
    config = _read(folder / "scheduler" / "scheduler_config.json")
    if not config:
        return default
    # from_config keeps the keys the scheduler takes (and its defaults for the rest), as from_pretrained loads it
    return {key: value for key, value in FlowMatchEulerDiscreteScheduler.from_config(config).config.items() if not key.startswith("_")}


def default_size(target_size: int, vae_spatial: int) -> tuple[int, int]:
    """(height, width) HunyuanVideo15Pipeline uses when a request gives neither: the 16:9 bucket of
    `target_size` among sizes in steps of the VAE's spatial ratio."""
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=vae_spatial)
    return processor.calculate_default_height_width(DEFAULT_ASPECT[1], DEFAULT_ASPECT[0], target_size)


def card_for_weights(card: ModelCard, components: Components) -> ModelCard:
    """`card` with the folder's scheduler config, guidance scale and default size (from its transformer's
    target_size). The transformer's `task_type` is not read: its forward decides text-to-video by the
    image embeddings being zero (and diffusers' conversion script writes "i2v" for the 480p t2v release)."""
    if components.transformer.config.get("use_meanflow", False):  # the pipeline then feeds the next timestep too
        raise CheckpointError(f"card {card.card_id!r}: the transformer's config says use_meanflow=True (a MeanFlow "
                              "distilled release); the HunyuanVideo-1.5 loops run the base recipe, without timestep_r")  # fmt: skip
    recipe, shapes = card.recipe, card.shapes
    sampler_config, guidance = recipe.sampler.config, recipe.default_guidance_scale
    if components.checkpoint is not None:
        sampler_config = _scheduler_config(components.checkpoint, sampler_config)
        guidance = _guidance_scale(components.checkpoint, guidance)
    height, width = default_size(int(components.transformer.config.target_size), components.facts.vae_spatial)
    sampler = SamplerSpec(name=recipe.sampler.name, config=sampler_config)
    return card.model_copy(update={
        "recipe": recipe.model_copy(update={"sampler": sampler, "default_guidance_scale": guidance}),
        "shapes": shapes.model_copy(update={"default_height": height, "default_width": width}),
    })  # fmt: skip
