"""FLUX.1 on the runtime: the released cards on checkpoints written by diffusers' own FluxPipeline
equal that pipeline; requests of other steps, guidance, sizes and seeds batch together and equal
each run alone; compiled steps equal eager; bad input is refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from pydantic import ValidationError

from fvgraph.cards import get_card
from fvgraph.cards.flux import SCHNELL_SCHEDULER
from fvgraph.card import ModelCard
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.parity import Setting, compare
from fvgraph.request import Request
from reference_helpers import (assert_matches_reference, assert_shares_no_storage, assert_within_compiled_noise, reference_pipeline,
                               saved_pipeline)  # fmt: skip


def _checkpoint(folder, card: ModelCard):
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(FluxPipeline, c, folder, scheduler=diffusers_scheduler(card.recipe.sampler))


@pytest.fixture(scope="module")
def dev_checkpoint(tmp_path_factory):
    """tiny-flux's seeded weights (guidance-distilled, as FLUX.1-dev) written by FluxPipeline.save_pretrained."""
    return _checkpoint(tmp_path_factory.mktemp("tiny-flux-dev"), get_card("tiny-flux"))


@pytest.fixture(scope="module")
def schnell_checkpoint(tmp_path_factory):
    """The same architecture without the guidance input and with schnell's unshifted schedule."""
    tiny = get_card("tiny-flux")
    components = {**tiny.components, "transformer": tiny.components["transformer"].model_copy(
        update={"config": {**tiny.components["transformer"].config, "guidance_embeds": False}})}  # fmt: skip
    recipe = tiny.recipe.model_copy(update={"sampler": SCHNELL_SCHEDULER})
    card = tiny.model_copy(update={"card_id": "tiny-flux-schnell", "components": components, "recipe": recipe})
    return _checkpoint(tmp_path_factory.mktemp("tiny-flux-schnell"), card)


def _reference_latents(pipe, height, width, **kwargs):
    packed = pipe(height=height, width=width, output_type="latent", **kwargs).images
    return FluxPipeline._unpack_latents(packed, height, width, pipe.vae_scale_factor).unsqueeze(2)


CASES = {
    "text, embedded guidance": dict(prompt="a red fox in snow", guidance_scale=3.5, num_inference_steps=5, height=64, width=64),
    "true cfg, another size": dict(prompt="a red fox in snow", prompt_2="a fox, winter", negative_prompt="blurry",
                                   true_cfg_scale=4.0, guidance_scale=2.0, num_inference_steps=4, height=48, width=80),
    "short text length": dict(prompt="a lighthouse at dusk", max_sequence_length=16, num_inference_steps=3, height=32, width=64),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_flux_dev_on_a_diffusers_checkpoint_matches_flux_pipeline(dev_checkpoint, case):
    engine = Engine.from_card("flux.1-dev", checkpoint=dev_checkpoint, device="cpu", dtype="fp32")  # a bf16 release
    pipe = reference_pipeline(FluxPipeline, dev_checkpoint)
    assert_shares_no_storage(engine, pipe)
    args = CASES[case]
    reference = _reference_latents(pipe, generator=torch.Generator().manual_seed(7), **args)
    [result] = engine.generate([Request(seed=7, output_type="latent", **args)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)


def test_flux_dev_images_and_embeddings_match_flux_pipeline(dev_checkpoint):
    """Decoded images (uint8, as the pipeline's PIL output rounds them) and the embeddings path."""
    engine = Engine.from_card("flux.1-dev", checkpoint=dev_checkpoint, device="cpu", dtype="fp32")
    pipe = reference_pipeline(FluxPipeline, dev_checkpoint)
    g = torch.Generator().manual_seed(3)
    embeds, pooled = torch.randn(1, 24, engine.facts.text_dim, generator=g), torch.randn(1, 32, generator=g)
    negative, negative_pooled = torch.randn(1, 24, engine.facts.text_dim, generator=g), torch.randn(1, 32, generator=g)
    args = dict(num_inference_steps=4, height=64, width=48, true_cfg_scale=3.0, guidance_scale=4.0)
    reference = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=negative,
                     negative_pooled_prompt_embeds=negative_pooled, generator=torch.Generator().manual_seed(11),
                     output_type="np", **args).images  # fmt: skip
    [result] = engine.generate([Request(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=negative,
                                        negative_pooled_prompt_embeds=negative_pooled, seed=11, **args)])  # fmt: skip
    assert result.ok, result.error
    assert result.images.shape == (1, 64, 48, 3) and result.images.dtype == np.uint8
    expected = (reference * 255).round().astype(np.uint8)
    assert np.abs(result.images.astype(int) - expected.astype(int)).max() <= 1


def test_flux_schnell_on_a_diffusers_checkpoint_matches_flux_pipeline(schnell_checkpoint):
    engine = Engine.from_card("flux.1-schnell", checkpoint=schnell_checkpoint, device="cpu", dtype="fp32")
    assert engine.card.recipe.default_steps == 4 and engine.card.shapes.text_len == 256
    pipe = reference_pipeline(FluxPipeline, schnell_checkpoint)
    args = dict(prompt="a bowl of ramen", height=64, width=64, max_sequence_length=32)
    reference = _reference_latents(pipe, generator=torch.Generator().manual_seed(2), num_inference_steps=4, guidance_scale=0.0, **args)
    [result] = engine.generate([Request(seed=2, output_type="latent", **args)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)
    [refused] = engine.generate([Request(seed=2, guidance_scale=3.5, **args)])
    assert refused.status == "rejected" and "guidance_scale" in refused.error and "no guidance input" in refused.error


def _mixed() -> list[Request]:
    return [
        Request(prompt="a red fox", seed=1, num_inference_steps=3, guidance_scale=3.5, height=64, width=64, request_id="a"),
        Request(prompt="a blue bird", seed=2, num_inference_steps=5, guidance_scale=2.0, height=64, width=64, request_id="b"),
        Request(prompt="a cat", negative_prompt="dark", true_cfg_scale=3.0, seed=3, num_inference_steps=4, height=64, width=64,
                request_id="c"),
        Request(prompt="a green tree", seed=4, num_inference_steps=4, guidance_scale=5.0, height=32, width=64, request_id="d"),
    ]  # fmt: skip


def test_interleaved_flux_requests_equal_each_alone_bit_for_bit():
    engine = Engine.from_card("tiny-flux", device="cpu")
    together = {r.request_id: r for r in engine.generate(_mixed())}
    for request in _mixed():
        [alone] = engine.generate([request])
        assert together[request.request_id].ok and alone.ok
        assert torch.equal(together[request.request_id].latents, alone.latents), request.request_id
        assert np.array_equal(together[request.request_id].images, alone.images)


def test_a_second_wave_of_other_guidance_and_steps_compiles_nothing():
    engine = Engine.from_card("tiny-flux", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"))
    first = engine.generate(_mixed())
    assert all(r.ok for r in first), [r.error for r in first]
    compiles = engine.counters.snapshot()["compiles"]
    second = [r.model_copy(update={"guidance_scale": 1.5 + i, "num_inference_steps": 2 + i, "seed": 40 + i}) for i, r in enumerate(_mixed())]
    for r in second:
        if r.true_cfg_scale is not None:
            r.true_cfg_scale = 6.0
    results = engine.generate(second)
    assert all(r.ok for r in results), [r.error for r in results]
    assert engine.counters.snapshot()["compiles"] == compiles


def test_a_compiled_flux_request_that_moves_rows_keeps_its_hoisted_values_and_padding_stays_out():
    """Three requests in one bucket-4 lane; the first ends and the third moves into its row. The
    position ids are the same for every row of a shape: they stay in the step, so a move copies only
    the request's own hoisted rows and the NaN padding reaches no one. Each equals eager alone."""
    from fvgraph.runtime.buckets import BucketSpec

    requests = [Request(prompt=f"a fox {i}", seed=i, num_inference_steps=steps, guidance_scale=2.0 + i, height=32, width=32,
                        output_type="latent") for i, steps in enumerate((2, 4, 4))]  # fmt: skip
    engine = Engine.from_card("tiny-flux", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                              buckets=BucketSpec(batch_sizes=(4,)))  # fmt: skip
    engine.executor.runner.pad_value = float("nan")
    with engine.counters.expect(prologue_runs=1):
        results = engine.generate(requests)
    entry = next(iter(engine.executor.runner._graphs.values()))
    assert entry.hoisted_for[0] is not None and entry.hoisted_for[2] is None  # the third request moved to row 0
    eager = Engine.from_card("tiny-flux", device="cpu")
    for result, request in zip(results, requests):
        [alone] = eager.generate([request])
        assert result.ok, result.error
        assert_within_compiled_noise(result.latents, alone.latents)


@pytest.mark.parametrize("level", [1, 2])
def test_compiled_flux_equals_eager_within_the_card_tolerance(level):
    """-O1 / -O2 (aot_eager: CFG fusion of the true-CFG branches, hoisting of the text stream) against -O0, tap by tap."""
    requests = [Request(prompt="a red fox", seed=1, num_inference_steps=3, height=64, width=64),
                Request(prompt="a cat", negative_prompt="dark", true_cfg_scale=3.0, seed=3, num_inference_steps=3, height=32, width=48)]  # fmt: skip
    report = compare("tiny-flux", requests, Setting(0), Setting(level, backend="aot_eager"))
    assert report.passed, report.first_divergence
    assert {c.tap for c in report.comparisons} >= {"tap.noise", "tap.latents"}


@pytest.mark.parametrize(
    "fields,name,rule",
    [
        (dict(height=40), "height", "multiple of 16"),
        (dict(width=4096), "width", "exceeds"),
        (dict(true_cfg_scale=4.0), "true_cfg_scale", "negative prompt"),
        (dict(num_frames=5), "num_frames", "makes images"),
        (dict(loras={"style": 1.0}), "loras", "serves no LoRA adapters"),
        (dict(rollout={"noise_level": 0.7}), "rollout", "rollouts run on single-expert text-to-video loops"),
        (dict(guidance_scale_2=2.0), "guidance_scale_2", "runs loop 'flux', which takes no guidance_scale_2"),
        (dict(max_sequence_length=64), "max_sequence_length", "exceeds"),
        (dict(prompt=None, prompt_embeds=torch.zeros(8, 32)), "pooled_prompt_embeds", "comes with"),
        (dict(prompt=None, prompt_embeds=torch.zeros(8, 32), pooled_prompt_embeds=torch.zeros(16)), "pooled_prompt_embeds", "takes [32]"),
    ],
)
def test_bad_flux_requests_are_refused_naming_the_field(tiny_flux, fields, name, rule):
    try:
        request = Request(**{"prompt": "x", **fields})
    except ValidationError as err:  # a rule of any card, checked when the request is built
        message = str(err)
    else:  # a rule of this card or its weights
        [result] = tiny_flux.generate([request])
        assert result.status == "rejected"
        message = result.error
    assert name in message and rule in message, message


def test_flux_fields_are_refused_by_wan_and_wan_fields_by_flux(tiny_engine):
    [result] = tiny_engine.generate([Request(prompt="x", prompt_2="y")])
    assert result.status == "rejected" and result.error.startswith("prompt_2:")
    [result] = tiny_engine.generate([Request(prompt="x", true_cfg_scale=2.0, negative_prompt="n")])
    assert result.status == "rejected" and result.error.startswith("true_cfg_scale:")


@pytest.fixture(scope="module")
def tiny_flux():
    return Engine.from_card("tiny-flux", device="cpu")
