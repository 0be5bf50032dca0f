"""HunyuanVideo-1.5 text-to-video on the runtime: the released card on a checkpoint written by diffusers'
own HunyuanVideo15Pipeline equals that pipeline (with and without classifier-free guidance, a quoted
glyph text, the folder's shift and guider scale); requests of other steps, scales and seeds batch
together and equal each run alone; compiled steps equal eager; bad input is refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance
from transformers import ByT5Tokenizer

from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.loops.hunyuan_video15_loop import SYSTEM_MESSAGE, HunyuanVideo15State
from fvgraph.models.components import load_components
from fvgraph.models.hunyuan_video15_forward import HunyuanVideo15TextToVideo
from fvgraph.parity import Setting, compare
from fvgraph.request import Request
from reference_helpers import assert_matches_reference, assert_shares_no_storage, assert_within_compiled_noise, reference_pipeline

SHIFT, GUIDANCE = 7.0, 4.5  # the folder's; the released card says 5.0 and 6.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-hunyuanvideo1.5's seeded weights written by HunyuanVideo15Pipeline.save_pretrained, with ByT5's
    own tokenizer, a scheduler shift and a guider scale other than the released card's."""
    c = load_components(get_card("tiny-hunyuanvideo1.5"), None, torch.device("cpu"))
    folder = tmp_path_factory.mktemp("tiny-hunyuanvideo1.5")
    HunyuanVideo15Pipeline(transformer=c.transformer, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                           text_encoder_2=c.text_encoder_2, tokenizer_2=ByT5Tokenizer(),
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
                           guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE)).save_pretrained(folder)  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def released(checkpoint):
    return Engine.from_card("hunyuanvideo1.5-480p-t2v", checkpoint=checkpoint, device="cpu", dtype="fp32")  # a bf16 release


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return reference_pipeline(HunyuanVideo15Pipeline, checkpoint)


@pytest.fixture(scope="module")
def tiny():
    return Engine.from_card("tiny-hunyuanvideo1.5", device="cpu")


def _with_guidance(pipe, scale: float) -> HunyuanVideo15Pipeline:
    """The reference's own modules with diffusers' ClassifierFreeGuidance at `scale`."""
    return HunyuanVideo15Pipeline(**{**pipe.components, "guider": ClassifierFreeGuidance(guidance_scale=scale)})


CASES = {
    "cfg, a negative prompt and a quoted glyph text": dict(prompt='a shop sign that reads "OPEN late" at night',
                                                           negative_prompt="blurry, low quality", guidance_scale=4.0,
                                                           num_inference_steps=3, height=32, width=48, num_frames=9),
    "no cfg": dict(prompt="a red fox running through snow", guidance_scale=1.0, num_inference_steps=3, height=48, width=32,
                   num_frames=5),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_hunyuanvideo15_on_a_diffusers_checkpoint_matches_the_pipeline(released, pipe, case):
    assert_shares_no_storage(released, pipe)
    args = dict(CASES[case])
    reference = _with_guidance(pipe, args.pop("guidance_scale"))
    expected = reference(generator=torch.Generator().manual_seed(7), output_type="latent", **args).frames
    [result] = released.generate([Request(seed=7, output_type="latent", guidance_scale=reference.guider.guidance_scale, **args)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, expected)


def test_the_folders_shift_guidance_and_size_are_run_and_frames_match(released, pipe):
    """No guidance_scale, height or width given: the guider folder's scale and the transformer's target
    size, as the pipeline loaded from the folder runs them; decoded frames equal its within a level."""
    card = released.loop.card
    assert card.recipe.default_guidance_scale == GUIDANCE and card.recipe.sampler.config["shift"] == SHIFT
    assert SYSTEM_MESSAGE == pipe.system_message
    args = dict(prompt="a lighthouse at dusk", negative_prompt="fog", num_inference_steps=2, num_frames=5)
    expected = pipe(generator=torch.Generator().manual_seed(3), output_type="np", **args).frames[0]  # [F, H, W, 3]
    [result] = released.generate([Request(seed=3, **args)])
    assert result.ok, result.error
    assert result.frames.shape == expected.shape == (5, 32, 48, 3)
    assert np.abs(result.frames.astype(int) - (expected * 255).round().astype(int)).max() <= 1


def test_guidance_one_encodes_no_negative_text(released):
    loop = released.loop
    state = loop.init(loop.check_request(Request(prompt="a cat", negative_prompt="dark", guidance_scale=1.0, seed=0)))
    assert state.encode_slots == ["prompt_embeds"] and state.input_ids.shape[0] == 1 and not state.cfg
    state = loop.init(loop.check_request(Request(prompt="a cat", negative_prompt="dark", guidance_scale=2.0, seed=0)))
    assert state.encode_slots == ["prompt_embeds", "negative_prompt_embeds"] and state.cfg


def test_the_text_to_video_forward_equals_the_transformers_bit_for_bit(tiny):
    """Padded texts and a ByT5 row without quoted text: the traced forward's token order is diffusers'."""
    transformer = tiny.loop.components.transformer
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 9, 3, 2, 3, generator=g)
    text, glyph = torch.randn(2, 1000, 16, generator=g), torch.randn(2, 256, 32, generator=g)
    mask, glyph_mask = torch.zeros(2, 1000, dtype=torch.int64), torch.zeros(2, 256, dtype=torch.int64)
    mask[0, :30], mask[1, :7], glyph_mask[0, :12] = 1, 1, 1
    timestep = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        expected = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, encoder_attention_mask=mask.float(),
                               encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask.float(),
                               image_embeds=torch.zeros(2, 729, 12), return_dict=False)[0]  # fmt: skip
        ours = HunyuanVideo15TextToVideo(transformer)(latents, timestep, text, mask, glyph, glyph_mask)[0]
    assert torch.equal(ours, expected)


def _mixed() -> list[Request]:
    return [
        Request(prompt='a sign saying "hi"', negative_prompt="blurry", guidance_scale=4.0, seed=1, num_inference_steps=3,
                num_frames=5, request_id="a"),
        Request(prompt="a blue bird", guidance_scale=1.0, seed=2, num_inference_steps=2, num_frames=5, request_id="b"),
        Request(prompt="a cat", negative_prompt="dark", guidance_scale=7.0, seed=3, num_inference_steps=4, num_frames=5,
                request_id="c"),
    ]  # fmt: skip


def test_interleaved_requests_equal_each_alone_bit_for_bit(tiny):
    together = {r.request_id: r for r in tiny.generate([r.model_copy(update={"output_type": "latent"}) for r in _mixed()])}
    for request in _mixed():
        [alone] = tiny.generate([request.model_copy(update={"output_type": "latent"})])
        assert together[request.request_id].ok and alone.ok
        assert torch.equal(together[request.request_id].latents, alone.latents), request.request_id


def _parity_requests() -> list[Request]:
    return [Request(prompt='a sign saying "hi"', negative_prompt="blurry", guidance_scale=4.0, seed=1, num_inference_steps=2,
                    num_frames=5),
            Request(prompt="a blue bird", guidance_scale=1.0, seed=2, num_inference_steps=2, num_frames=5)]  # fmt: skip


@pytest.mark.parametrize("level", [1, 2])
def test_compiled_equals_eager_within_the_card_tolerance(level):
    """-O1 / -O2 (aot_eager: the CFG branches fused into one call, request constants hoisted) against -O0, tap by tap."""
    report = compare("tiny-hunyuanvideo1.5", _parity_requests(), Setting(0), Setting(level, backend="aot_eager"))
    assert report.passed, report.first_divergence
    assert {c.tap for c in report.comparisons} >= {"tap.noise", "tap.latents", "tap.block.1.0", "tap.block.1.1"}


def test_the_cfg_step_is_traced_fused_and_a_second_wave_compiles_nothing(tiny):
    """At -O1 the guided step is traced once with its two branches as one call at twice the batch (the
    per-row text masks ride along), equals eager within the compiled tolerance, and other steps,
    scales and seeds reuse the graphs."""
    engine = Engine.from_card("tiny-hunyuanvideo1.5", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"))
    first = engine.generate([r.model_copy(update={"output_type": "latent"}) for r in _mixed()])
    assert all(r.ok for r in first), [r.error for r in first]
    fused = {c.signature.step_kind: c.passes_changed.get("cfg_fusion", 0) for c in engine.compiler.compiled_steps}
    assert fused["denoise_cfg"] == 1, fused
    eager = {r.request_id: r for r in tiny.generate([r.model_copy(update={"output_type": "latent"}) for r in _mixed()])}
    for result in first:
        assert_within_compiled_noise(result.latents, eager[result.request_id].latents)
    compiles = engine.counters.snapshot()["compiles"]
    second = [r.model_copy(update={"num_inference_steps": 2 + i, "seed": 40 + i, "output_type": "latent",
                                   "guidance_scale": 1.0 if r.guidance_scale == 1.0 else 3.0 + i}) for i, r in enumerate(_mixed())]  # fmt: skip
    assert all(r.ok for r in engine.generate(second))
    assert engine.counters.snapshot()["compiles"] == compiles


@pytest.mark.parametrize("steps_before_save", [0, 1, 3])
def test_a_state_saved_mid_run_resumes_bit_for_bit(tmp_path, tiny, steps_before_save):
    """Saved before the text encode (both encoders' token ids), after it (four tensors per text) or between steps."""
    request = Request(prompt='a paper boat named "Ada"', negative_prompt=" ", guidance_scale=3.0, seed=9, num_inference_steps=2,
                      num_frames=5, output_type="latent")  # fmt: skip
    uninterrupted = tiny.generate([request])[0]
    state = tiny.start(request)
    for _ in range(steps_before_save):
        tiny.step(state)
    state.save(tmp_path / "state.pt")
    fresh = Engine.from_card("tiny-hunyuanvideo1.5", device="cpu")
    resumed = fresh.finish(fresh.resume(HunyuanVideo15State.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, uninterrupted.latents)


def test_a_saved_state_with_a_bad_glyph_mask_is_refused(tiny):
    state = tiny.start(Request(prompt="a fox", seed=0, num_inference_steps=2, num_frames=5, guidance_scale=1.0))
    tiny.step(state)  # text encode: the four tensors of the prompt
    state.prompt_embeds_mask_2 = state.prompt_embeds_mask_2[:, :100]
    with pytest.raises(ValueError, match="prompt_embeds_mask_2: must have shape"):
        tiny.resume(state)


def test_an_engine_without_its_text_encoders_is_refused_at_build():
    with pytest.raises(ValueError, match="encodes its texts itself.*text_encoder=True"):
        Engine.from_card("tiny-hunyuanvideo1.5", device="cpu", text_encoder=False)


@pytest.mark.parametrize(
    "fields,name,rule",
    [
        (dict(guidance_scale=0.5), "guidance_scale", "scale >= 1"),
        (dict(height=40), "height", "multiple of 16"),
        (dict(width=256), "width", "exceeds"),
        (dict(num_frames=6), "num_frames", "4k+1"),
        (dict(cache="teacache"), "cache.coefficients", "declares no TeaCache coefficients"),
        (dict(prompt=None, prompt_embeds=torch.zeros(8, 16)), "prompt_embeds", "encodes its texts itself"),
        (dict(prompt_2="y"), "prompt_2", "takes no prompt_2"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(tiny, fields, name, rule):
    try:
        request = Request(**{"prompt": "x", **fields})
    except ValueError as err:  # refused by the request's own validation
        assert name in str(err) and rule in str(err)
        return
    [result] = tiny.generate([request])
    assert not result.ok and name in result.error and rule in result.error, result.error
