"""ModelCard validation happens before any weight loads, and names what is wrong."""

import pytest
from pydantic import ValidationError

from fvgraph.card import ModelCard, RecipeSpec
from fvgraph.cards import card_names, get_card
from fvgraph.request import Request


def _with(card, **changes):
    data = card.model_dump()
    data.update(changes)
    return data


def test_registry_has_the_wan_cards():
    assert {"tiny-wan", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b"} <= set(card_names())
    assert get_card("tiny-wan").embeds_weights
    assert not get_card("wan2.1-t2v-14b").embeds_weights


def test_recipe_must_assume_a_loop_the_card_has(tiny_card):
    recipe = tiny_card.recipe.model_copy(update={"assumes_loop": "i2v"})
    with pytest.raises(ValidationError, match="assumes_loop='i2v'"):
        ModelCard.model_validate(_with(tiny_card, recipe=recipe.model_dump()))


def test_default_steps_must_be_allowed(tiny_card):
    with pytest.raises(ValidationError, match="default_steps=8 is outside allowed_steps"):
        RecipeSpec.model_validate({**tiny_card.recipe.model_dump(), "allowed_steps": (1, 4)})


def test_missing_component_is_named(tiny_card):
    components = {k: v for k, v in tiny_card.model_dump()["components"].items() if k != "vae"}
    with pytest.raises(ValidationError, match=r"missing \['vae'\]"):
        ModelCard.model_validate(_with(tiny_card, components=components))


def test_unknown_fields_are_rejected(tiny_card):
    with pytest.raises(ValidationError, match="Extra inputs"):
        ModelCard.model_validate(_with(tiny_card, flow_shift=5.0))


def test_base_recipe_rejects_steps_outside_its_range(tiny_card):
    """A request outside the recipe's step range is refused with a typed error naming the recipe
    (the distilled recipes' contract: tests/test_distilled_recipes.py)."""
    from fvgraph.request import Request, RequestRejected

    with pytest.raises(RequestRejected, match=r"outside \[1, 50\].*recipe 'base'"):
        Request(prompt="x", num_inference_steps=51).resolve(tiny_card)


def test_wan_cpu_bench_is_the_wan_architecture_at_a_cpu_benchmark_size():
    """The benchmarks' CPU card: diffusers' Wan transformer with the released head size, seeded, and a
    default shape it accepts (the step's cost is checked by perf/, not here)."""
    card = get_card("wan-cpu-bench")
    dit = card.components["transformer"]
    assert dit.cls == "diffusers.WanTransformer3DModel" and card.embeds_weights and card.seed is not None
    assert dit.config["attention_head_dim"] == get_card("wan2.1-1.3b-bench").components["transformer"].config["attention_head_dim"]
    assert dit.config["text_dim"] == card.components["text_encoder"].config["d_model"]
    assert card.shapes.text_len == get_card("wan2.1-t2v-1.3b").shapes.text_len == 512  # the hoisted share is Wan's
    resolved = Request(prompt="a fox").resolve(card)
    assert (resolved.num_frames, resolved.height, resolved.width) == (9, 128, 128)
