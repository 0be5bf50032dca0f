"""The recipe and precision a run uses are visible and settable: a checkpoint whose scheduler and
pipeline configs differ from the card is warned about, `recipe=` runs the checkpoint's values (and
then matches diffusers on that folder as it is), and `dtype=` runs a bf16 card in fp32."""

import logging

import pytest
import torch
from diffusers import WanPipeline
from typer.testing import CliRunner

from fvgraph.card import SamplerSpec
from fvgraph.card_choices import RECIPE_CHOICES, with_dtype, with_recipe
from fvgraph.cards import get_card
from fvgraph.cli import app
from fvgraph.models.components import diffusers_scheduler
from fvgraph.request import Request
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

RELEASED = "wan2.2-t2v-a14b"  # bf16, flow_shift 12.0, boundary_ratio 0.875
SHAPE = {"height": 48, "width": 64, "num_frames": 5, "num_inference_steps": 6}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Wan 2.2 A14B checkpoint (tiny weights) saved with flow_shift 3.0 and boundary_ratio 0.5."""
    tiny = get_card("tiny-wan2.2-a14b")
    sampler = SamplerSpec(name="unipc", config={**tiny.recipe.sampler.config, "flow_shift": 3.0})
    return saved_pipeline(WanPipeline, load_components(tiny, None, torch.device("cpu")), tmp_path_factory.mktemp("a14b-shift3"),
                          scheduler=diffusers_scheduler(sampler), boundary_ratio=0.5)  # fmt: skip


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fvgraph.runtime.checkpoint_recipe"]


def test_a_checkpoint_that_differs_from_the_card_is_warned_about_and_the_card_runs(folder, caplog):
    card = get_card(RELEASED)
    assert card.recipe.sampler.config["flow_shift"] == 12.0 and card.recipe.boundary_ratio == 0.875
    with caplog.at_level(logging.WARNING, logger="fvgraph.runtime.checkpoint_recipe"):
        engine = Engine.from_card(RELEASED, checkpoint=folder, device="cpu", dtype="fp32")
    said = _warnings(caplog)
    assert any("flow_shift: the run uses 12.0; the checkpoint's scheduler/scheduler_config.json says 3.0" in w
               and "--flow-shift" in w for w in said), said  # fmt: skip
    assert any("boundary_ratio: the run uses 0.875; the checkpoint's model_index.json says 0.5" in w for w in said), said
    assert len(said) == 2  # expand_timesteps agrees (False, a text-to-video loop)
    assert engine.card.recipe.sampler.config["flow_shift"] == 12.0 and engine.card.recipe.boundary_ratio == 0.875


def test_recipe_runs_the_checkpoints_values_and_matches_diffusers_on_the_folder_as_it_is(folder, caplog):
    """dtype="fp32" on the bf16 card, recipe= the folder's: diffusers' WanPipeline loaded from the
    folder with its own scheduler and boundary is the reference."""
    with caplog.at_level(logging.WARNING, logger="fvgraph.runtime.checkpoint_recipe"):
        engine = Engine.from_card(RELEASED, checkpoint=folder, device="cpu", dtype="fp32",
                                  recipe={"flow_shift": 3.0, "boundary_ratio": 0.5})  # fmt: skip
    assert _warnings(caplog) == []
    assert get_card(RELEASED).recipe.boundary_ratio == 0.875  # the released card itself is unchanged
    assert engine.card.recipe.precision == "fp32" and engine.loop.components.transformer.dtype == torch.float32
    pipe = reference_pipeline(WanPipeline, folder)
    assert pipe.config.boundary_ratio == 0.5 and pipe.scheduler.config.flow_shift == 3.0
    assert_shares_no_storage(engine, pipe)
    g = torch.Generator().manual_seed(8)
    positive, negative = (torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(2))
    reference = pipe(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=4.0, guidance_scale_2=2.0,
                     generator=torch.Generator().manual_seed(2), output_type="latent", **SHAPE).frames  # fmt: skip
    kinds = []
    [result] = engine.generate([Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=4.0,
                                        guidance_scale_2=2.0, seed=2, output_type="latent", **SHAPE)],
                               on_step=lambda state, kind: kinds.append(kind))  # fmt: skip
    assert result.ok, result.error
    assert "denoise_cfg" in kinds and "denoise_cfg_2" in kinds  # both experts ran, split at 0.5
    assert_matches_reference(result.latents, reference)
    assert result.provenance["recipe"] == {"name": "base", "method": "base", "assumes_precision": "fp32", "flow_shift": 3.0,
                                           "boundary_ratio": 0.5, "expand_timesteps": False}  # fmt: skip
    assert result.provenance["card_id"] == RELEASED and result.provenance["precision"] == "fp32"


@pytest.mark.parametrize(
    "choose, rule",
    [
        (lambda card: with_recipe(card, {"shift": 3.0}), "recipe: unknown key 'shift'; the keys a run may set are " + str(list(RECIPE_CHOICES))),
        (lambda card: with_recipe(card, {"boundary_ratio": 0.5}), "recipe: boundary_ratio: card 'tiny-wan' has one denoiser expert"),
        (lambda card: with_recipe(card, {"default_steps": 0}), "default_steps"),
        (lambda card: with_dtype(card, "int8"), "dtype='int8' must be one of ['fp32', 'bf16', 'fp16']"),
        (lambda card: with_dtype(card, torch.float64), "dtype=torch.float64 is not one of"),
        (lambda card: with_dtype(card, "fp16"), "dtype='fp16': card 'tiny-wan' declares parity tolerances only for"),
    ],
)
def test_bad_choices_are_refused_naming_the_key(choose, rule):
    with pytest.raises(ValueError, match=None) as info:
        choose(get_card("tiny-wan"))
    assert rule in str(info.value)


def test_dtype_takes_a_torch_dtype_and_leaves_the_vae_in_its_own():
    card = with_dtype(get_card("wan2.1-t2v-1.3b"), torch.float32)
    assert card.recipe.precision == "fp32"
    assert {name: spec.dtype for name, spec in card.components.items() if spec.kind != "tokenizer"} == {
        "transformer": "fp32", "vae": "fp32", "text_encoder": "fp32"}  # fmt: skip
    assert with_dtype(get_card("tiny-wan"), "bf16").components["vae"].dtype == "fp32"


def test_the_cli_shows_and_sets_the_recipe(folder):
    runner = CliRunner()
    shown = runner.invoke(app, ["env", "--json", "--card", RELEASED, "--checkpoint", str(folder), "--dtype", "fp32"])
    assert shown.exit_code == 0, shown.output
    assert '"precision": "fp32"' in shown.output
    assert "flow_shift: the run uses 12.0; the checkpoint's scheduler/scheduler_config.json says 3.0 (differs)" in shown.output
    chosen = runner.invoke(app, ["env", "--json", "--card", RELEASED, "--checkpoint", str(folder), "--flow-shift", "3",
                                 "--boundary-ratio", "0.5"])  # fmt: skip
    assert chosen.exit_code == 0 and "(differs)" not in chosen.output, chosen.output
    refused = runner.invoke(app, ["generate", "--card", "tiny-wan", "--boundary-ratio", "0.5", "--device", "cpu"])
    assert refused.exit_code == 2 and "--boundary-ratio: recipe: boundary_ratio: card 'tiny-wan' has one denoiser expert" in " ".join(refused.output.split())
