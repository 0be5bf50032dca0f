"""Qwen-Image on the runtime: the released card on a checkpoint written by diffusers' own
QwenImagePipeline equals that pipeline (texts padded to one length with their masks included);
requests of other steps, true-CFG scales, sizes, text lengths and seeds batch together and equal each
run alone; compiled steps equal eager; bad input is refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from pydantic import ValidationError

from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.loops.qwen_image_loop import TEXT_BUCKET, QwenImageState
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.parity import Setting, compare
from fvgraph.request import Request
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-qwen-image's seeded weights written by QwenImagePipeline.save_pretrained."""
    card = get_card("tiny-qwen-image")
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(QwenImagePipeline, c, tmp_path_factory.mktemp("tiny-qwen-image"),
                          scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip


@pytest.fixture(scope="module")
def released(checkpoint):
    return Engine.from_card("qwen-image", checkpoint=checkpoint, device="cpu", dtype="fp32")  # a bf16 release


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return reference_pipeline(QwenImagePipeline, checkpoint)


def _reference_latents(pipe, height, width, **kwargs):
    packed = pipe(height=height, width=width, output_type="latent", **kwargs).images
    return QwenImagePipeline._unpack_latents(packed, height, width, pipe.vae_scale_factor)


CASES = {
    "text, no guidance": dict(prompt="a red fox in snow", true_cfg_scale=1.0, num_inference_steps=4, height=64, width=64),
    "true cfg, another size": dict(prompt="a red fox in snow", negative_prompt="blurry, low quality", true_cfg_scale=4.0,
                                   num_inference_steps=4, height=48, width=80),
    "the default true cfg with a negative prompt": dict(prompt="a lighthouse at dusk", negative_prompt=" ",
                                                        num_inference_steps=3, height=64, width=48),
    "short text length": dict(prompt="a lighthouse at dusk on a rocky shore", negative_prompt="fog", true_cfg_scale=2.5,
                              max_sequence_length=20, num_inference_steps=3, height=32, width=64),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_qwen_image_on_a_diffusers_checkpoint_matches_qwen_image_pipeline(released, pipe, case):
    assert_shares_no_storage(released, pipe)
    args = CASES[case]
    reference = _reference_latents(pipe, generator=torch.Generator().manual_seed(7), **args)
    [result] = released.generate([Request(seed=7, output_type="latent", **args)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)


def test_texts_are_padded_to_one_bucketed_length_with_their_masks(released):
    loop = released.loop
    request = loop.check_request(Request(prompt="a red fox", negative_prompt=" ", seed=1, num_inference_steps=2))
    state = loop.init(request)
    while state.phase == "encode":
        plan = loop.next(state)
        state = loop.advance(state, _run(released, plan))
    lengths = [int(state.prompt_embeds_mask.sum()), int(state.negative_prompt_embeds_mask.sum())]
    assert lengths[0] > lengths[1] > 0  # each text keeps its own tokens: the template's user part, without the system prompt
    assert state.prompt_embeds.shape[1] == state.negative_prompt_embeds.shape[1] == TEXT_BUCKET * -(-lengths[0] // TEXT_BUCKET)
    assert not state.negative_prompt_embeds[0, lengths[1]:].any()  # zero past the text, as the pipeline pads its batch


def _run(engine, plan):
    step = engine.loop.build_steps()[plan.kind]
    with torch.no_grad():
        return step(**plan.inputs)


def test_qwen_image_images_and_embeddings_with_masks_match_qwen_image_pipeline(released, pipe):
    """Decoded images (uint8, as the pipeline's PIL output rounds them) and embeddings with padding masks."""
    g = torch.Generator().manual_seed(3)
    embeds, negative = torch.randn(1, 24, released.facts.text_dim, generator=g), torch.randn(1, 10, released.facts.text_dim, generator=g)
    mask = torch.ones(1, 24, dtype=torch.int64)
    mask[:, 17:] = 0  # padded past token 17, as a batch encoded together would be
    args = dict(num_inference_steps=4, height=64, width=48, true_cfg_scale=3.0)
    reference_latents = _reference_latents(pipe, prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative,
                                           generator=torch.Generator().manual_seed(11), **args)  # fmt: skip
    reference = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative,
                     generator=torch.Generator().manual_seed(11), output_type="np", **args).images  # fmt: skip
    [result] = released.generate([Request(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative, seed=11,
                                          **args)])  # fmt: skip
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference_latents)
    assert result.images.shape == (1, 64, 48, 3) and result.images.dtype == np.uint8
    expected = (reference * 255).round().astype(np.uint8)
    assert np.abs(result.images.astype(int) - expected.astype(int)).max() <= 1


def _mixed() -> list[Request]:
    return [
        Request(prompt="a red fox", seed=1, num_inference_steps=3, height=64, width=64, request_id="a"),
        Request(prompt="a blue bird over a long winding river at dawn", negative_prompt=" ", seed=2, num_inference_steps=5,
                height=64, width=64, request_id="b"),
        Request(prompt="a cat", negative_prompt="dark", true_cfg_scale=2.0, seed=3, num_inference_steps=4, height=64, width=64,
                request_id="c"),
        Request(prompt="a green elm", seed=4, num_inference_steps=4, height=32, width=64, request_id="d"),
    ]  # fmt: skip


def test_interleaved_qwen_image_requests_equal_each_alone_bit_for_bit(tiny_qwen_image):
    together = {r.request_id: r for r in tiny_qwen_image.generate(_mixed())}
    for request in _mixed():
        [alone] = tiny_qwen_image.generate([request])
        assert together[request.request_id].ok and alone.ok
        assert torch.equal(together[request.request_id].latents, alone.latents), request.request_id
        assert np.array_equal(together[request.request_id].images, alone.images)


def test_a_second_wave_of_other_scales_and_steps_compiles_nothing():
    engine = Engine.from_card("tiny-qwen-image", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"))
    first = engine.generate(_mixed())
    assert all(r.ok for r in first), [r.error for r in first]
    compiles = engine.counters.snapshot()["compiles"]
    # One more character each: other text lengths, within the same TEXT_BUCKET (a longer text past it is a new signature).
    second = [r.model_copy(update={"num_inference_steps": 2 + i, "seed": 40 + i, "prompt": r.prompt + "!"}) for i, r in enumerate(_mixed())]
    for r in second:
        if r.negative_prompt is not None:
            r.true_cfg_scale = 6.0
    results = engine.generate(second)
    assert all(r.ok for r in results), [r.error for r in results]
    assert engine.counters.snapshot()["compiles"] == compiles


@pytest.mark.parametrize("level", [1, 2])
def test_compiled_qwen_image_equals_eager_within_the_card_tolerance(level):
    """-O1 / -O2 (aot_eager: CFG fusion of the true-CFG branches, hoisting of the text stream) against -O0, tap by tap."""
    requests = [Request(prompt="a red fox", seed=1, num_inference_steps=3, height=64, width=64),
                Request(prompt="a cat", negative_prompt="dark", true_cfg_scale=3.0, seed=3, num_inference_steps=3, height=32,
                        width=48)]  # fmt: skip
    report = compare("tiny-qwen-image", requests, Setting(0), Setting(level, backend="aot_eager"))
    assert report.passed, report.first_divergence
    assert {c.tap for c in report.comparisons} >= {"tap.noise", "tap.latents"}


@pytest.mark.parametrize("steps_before_save", [0, 1, 3])
def test_a_qwen_image_state_saved_mid_run_resumes_bit_for_bit(tmp_path, tiny_qwen_image, steps_before_save):
    """Saved before the text encode (texts of their own lengths), after it (padded, with masks) or between steps."""
    request = Request(prompt="a paper boat", negative_prompt=" ", seed=9, num_inference_steps=3, height=32, width=32)
    uninterrupted = tiny_qwen_image.generate([request])[0]
    state = tiny_qwen_image.start(request)
    for _ in range(steps_before_save):
        tiny_qwen_image.step(state)
    state.save(tmp_path / "state.pt")
    fresh = Engine.from_card("tiny-qwen-image", device="cpu")
    resumed = fresh.finish(fresh.resume(QwenImageState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, uninterrupted.latents)
    assert np.array_equal(resumed.images, uninterrupted.images)


def test_a_saved_state_with_texts_of_two_lengths_is_refused(tiny_qwen_image):
    state = tiny_qwen_image.start(Request(prompt="a fox", negative_prompt=" ", seed=0, num_inference_steps=2, height=32, width=32))
    tiny_qwen_image.step(state)  # text encode: both texts padded to one length
    state.negative_prompt_embeds, state.negative_prompt_embeds_mask = state.negative_prompt_embeds[:, :5], state.negative_prompt_embeds_mask[:, :5]
    with pytest.raises(ValueError, match="negative_prompt_embeds: must be as long as prompt_embeds"):
        tiny_qwen_image.resume(state)


EMBEDS = torch.zeros(8, 32)


@pytest.mark.parametrize(
    "fields,name,rule",
    [
        (dict(height=40), "height", "multiple of 16"),
        (dict(num_inference_steps=1), "num_inference_steps", "outside [2, 100]"),
        (dict(width=4096), "width", "exceeds"),
        (dict(true_cfg_scale=4.0), "true_cfg_scale", "negative prompt"),
        (dict(num_frames=5), "num_frames", "makes images"),
        (dict(cache="fbcache"), "cache", "no step caching"),
        (dict(guidance_scale=3.5), "guidance_scale", "no guidance input"),
        (dict(max_sequence_length=1024), "max_sequence_length", "exceeds"),
        (dict(prompt_2="y"), "prompt_2", "takes no prompt_2"),
        (dict(prompt_embeds_mask=torch.ones(8)), "prompt_embeds_mask", "pass prompt_embeds with it"),
        (dict(prompt=None, prompt_embeds=EMBEDS, prompt_embeds_mask=torch.ones(7)), "prompt_embeds_mask", "one entry per token"),
        (dict(prompt=None, prompt_embeds=EMBEDS, prompt_embeds_mask=torch.full((8,), 2)), "prompt_embeds_mask", "only 0"),
        (dict(prompt=None, prompt_embeds=EMBEDS, prompt_embeds_mask=torch.ones(2, 8)), "prompt_embeds_mask", "[seq_len]"),
        (dict(prompt=None, prompt_embeds=torch.zeros(8, 16)), "prompt_embeds", "expected [seq_len <= 512, 32]"),
    ],
)
def test_bad_qwen_image_requests_are_refused_naming_the_field(tiny_qwen_image, fields, name, rule):
    try:
        request = Request(**{"prompt": "x", **fields})
    except ValidationError as err:  # a rule of any card, checked when the request is built
        message = str(err)
    else:  # a rule of this card or its weights
        [result] = tiny_qwen_image.generate([request])
        assert result.status == "rejected"
        message = result.error
    assert name in message and rule in message, message


def test_the_masks_are_refused_by_loops_that_take_none(tiny_engine):
    [result] = tiny_engine.generate([Request(prompt_embeds=torch.zeros(4, tiny_engine.facts.text_dim), prompt_embeds_mask=torch.ones(4))])
    assert result.status == "rejected" and result.error.startswith("prompt_embeds_mask:") and "takes no" in result.error
    flux = Engine.from_card("tiny-flux", device="cpu")
    [result] = flux.generate([Request(prompt_embeds=torch.zeros(4, 32), pooled_prompt_embeds=torch.zeros(32),
                                      prompt_embeds_mask=torch.ones(4))])  # fmt: skip
    assert result.status == "rejected" and result.error.startswith("prompt_embeds_mask:")


@pytest.fixture(scope="module")
def tiny_qwen_image():
    return Engine.from_card("tiny-qwen-image", device="cpu")


def test_one_step_is_refused_because_the_schedulers_terminal_stretch_makes_it_nan():
    """Why the card takes at least 2 steps: diffusers' scheduler on the card's config, as QwenImagePipeline
    sets it (sigmas linspace(1, 1 / n, n), mu from the image's tokens), has a NaN sigma at n = 1 only."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**get_card("qwen-image").recipe.sampler.config)
    for n in (1, 2):
        with np.errstate(divide="ignore", invalid="ignore"):
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=0.5)
        assert scheduler.sigmas.isnan().any() == (n == 1)
    assert get_card("qwen-image").recipe.allowed_steps[0] == 2 == get_card("qwen-image-edit").recipe.allowed_steps[0]
