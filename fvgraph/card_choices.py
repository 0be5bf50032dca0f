"""What a user may choose over a card without writing one: the precision it runs in and a few recipe
values (Engine.from_card's `dtype=` and `recipe=`, the CLI's --dtype, --flow-shift, --boundary-ratio).

    card = with_dtype(get_card("wan2.1-t2v-1.3b"), "fp32")       # a bf16 release, run in fp32
    card = with_recipe(card, {"flow_shift": 5.0})

Each returns a new, validated card; the released card itself is never changed.
"""

from __future__ import annotations

from typing import Any

import torch

from fvgraph.card import ModelCard, RecipeSpec

# The component kinds that run in the card's precision; the VAE and the image encoder keep their own
# dtype (fp32 in every Wan card, as in diffusers' Wan examples).
_PRECISION_KINDS = ("dit", "text_encoder")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# recipe= keys: the sampler's flow_shift, and the RecipeSpec fields a run may set.
RECIPE_CHOICES = ("flow_shift", "boundary_ratio", "default_steps", "default_guidance_scale", "default_guidance_scale_2")


def dtype_name(dtype: str | torch.dtype) -> str:
    """'fp32', 'bf16' or 'fp16' for a name or a torch dtype (as diffusers' torch_dtype takes it)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype={dtype} is not one of {sorted(map(str, _DTYPE_NAMES))}")
        return _DTYPE_NAMES[dtype]
    if dtype not in _DTYPE_NAMES.values():
        raise ValueError(f"dtype={dtype!r} must be one of {list(_DTYPE_NAMES.values())} or a torch dtype among them")
    return dtype


def with_dtype(card: ModelCard, dtype: str | torch.dtype) -> ModelCard:
    """`card` with its denoiser(s) and text encoder in `dtype` and recipe.precision set to it."""
    name = dtype_name(dtype)
    if name not in card.parity.tolerances:
        raise ValueError(f"dtype={name!r}: card {card.card_id!r} declares parity tolerances only for {sorted(card.parity.tolerances)}")
    components = {key: spec.model_copy(update={"dtype": name}) if spec.kind in _PRECISION_KINDS else spec
                  for key, spec in card.components.items()}  # fmt: skip
    return card.model_copy(update={"components": components, "recipe": card.recipe.model_copy(update={"precision": name})})


def with_recipe(card: ModelCard, choices: dict[str, Any]) -> ModelCard:
    """`card` with the recipe values in `choices` (keys in RECIPE_CHOICES), validated as the card's own."""
    unknown = sorted(set(choices) - set(RECIPE_CHOICES))
    if unknown:
        raise ValueError(f"recipe: unknown key {unknown[0]!r}; the keys a run may set are {list(RECIPE_CHOICES)}")
    # a distill's expert boundary falls between two of its listed timesteps: it is part of the schedule
    fixed = sorted({"flow_shift", "default_steps", "boundary_ratio"} & set(choices)) if card.recipe.step_distilled else []
    if fixed:
        raise ValueError(f"recipe: {fixed[0]}: card {card.card_id!r} runs recipe {card.recipe.name!r} ({card.recipe.method}), "
                         "whose schedule is the one it was distilled on")  # fmt: skip
    recipe = card.recipe.model_dump()
    if "flow_shift" in choices:
        if "flow_shift" not in recipe["sampler"]["config"]:
            raise ValueError(f"recipe: flow_shift: card {card.card_id!r}'s sampler {card.recipe.sampler.name!r} has no flow_shift")
        recipe["sampler"]["config"]["flow_shift"] = float(choices["flow_shift"])
    if "boundary_ratio" in choices and card.recipe.boundary_ratio is None:
        raise ValueError(f"recipe: boundary_ratio: card {card.card_id!r} has one denoiser expert; only two-expert cards switch at a boundary")
    recipe.update({key: value for key, value in choices.items() if key != "flow_shift"})
    return card.model_copy(update={"recipe": RecipeSpec.model_validate(recipe)})


def chosen_card(card: ModelCard, dtype: str | torch.dtype | None = None, recipe: dict[str, Any] | None = None) -> ModelCard:
    """`card` as a run chose it: Engine.from_card's `dtype=` and `recipe=` applied (None: the card's own)."""
    if dtype is not None:
        card = with_dtype(card, dtype)
    if recipe:
        card = with_recipe(card, recipe)
    return card
