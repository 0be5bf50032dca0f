"""HunyuanVideo-1.5 image-to-video on the runtime: the released i2v card on a checkpoint written by diffusers'
own HunyuanVideo15ImageToVideoPipeline equals that pipeline (classifier-free guidance with a negative
prompt, an image of another size than the video, the size its bucket or the request's); requests with
other images, steps and seeds batch together and equal each run alone; the -O1 step equals eager within
the compiled tolerance and a second wave compiles nothing; a request without its image is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline
from diffusers.guiders import ClassifierFreeGuidance
from PIL import Image
from transformers import ByT5Tokenizer

from fvgraph.card_for_checkpoint import card_for_checkpoint
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.loops.hunyuan_video15_i2v_loop import HunyuanVideo15I2VState, HunyuanVideo15ImageToVideoLoop
from fvgraph.models.components import CheckpointError, load_components
from fvgraph.models.hunyuan_video15_forward import HunyuanVideo15TextToVideo
from fvgraph.parity import Setting, compare
from fvgraph.request import Request, RequestRejected
from reference_helpers import assert_matches_reference, assert_shares_no_storage, assert_within_compiled_noise, reference_pipeline

SHIFT, GUIDANCE = 7.0, 4.5  # the folder's; the released card says 5.0 and 6.0
CARD = "hunyuanvideo1.5-480p-i2v"


def _image(seed: int, width: int = 70, height: int = 40) -> Image.Image:
    """A seeded RGB image, wider than tall: its bucket at target size 48 is 48 wide, 32 high."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-hunyuanvideo1.5-i2v's seeded weights written by HunyuanVideo15ImageToVideoPipeline.save_pretrained,
    with ByT5's own tokenizer, a scheduler shift and a guider scale other than the released card's."""
    c = load_components(get_card("tiny-hunyuanvideo1.5-i2v"), None, torch.device("cpu"))
    folder = tmp_path_factory.mktemp("tiny-hunyuanvideo1.5-i2v")
    HunyuanVideo15ImageToVideoPipeline(
        transformer=c.transformer, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
        tokenizer_2=ByT5Tokenizer(), scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE), image_encoder=c.image_encoder, feature_extractor=c.image_processor,
    ).save_pretrained(folder)  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def released(checkpoint):
    return Engine.from_card(CARD, checkpoint=checkpoint, device="cpu", dtype="fp32")  # a bf16 release


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return reference_pipeline(HunyuanVideo15ImageToVideoPipeline, checkpoint)


def test_the_pipelines_folder_is_served_by_the_released_i2v_card(checkpoint):
    """A folder of HunyuanVideo15ImageToVideoPipeline, no card named: model_index.json's class picks it."""
    assert card_for_checkpoint(checkpoint, checkpoint).card_id == CARD


def _with_guidance(pipe, scale: float) -> HunyuanVideo15ImageToVideoPipeline:
    """The reference's own modules with diffusers' ClassifierFreeGuidance at `scale`."""
    return HunyuanVideo15ImageToVideoPipeline(**{**pipe.components, "guider": ClassifierFreeGuidance(guidance_scale=scale)})


def test_image_to_video_with_cfg_matches_the_pipeline_at_the_images_bucket(released, pipe):
    """A 70x40 image, no size given: both generate 48x32 (its bucket), with a negative prompt and a quoted text."""
    assert_shares_no_storage(released, pipe)
    args = dict(prompt='a shop sign that reads "OPEN" at night', negative_prompt="blurry, low quality", num_inference_steps=3,
                num_frames=9)  # fmt: skip
    reference = _with_guidance(pipe, 4.0)
    expected = reference(image=_image(0), generator=torch.Generator().manual_seed(7), output_type="latent", **args).frames
    [result] = released.generate([Request(image=_image(0), seed=7, output_type="latent", guidance_scale=4.0, **args)])
    assert result.ok, result.error
    assert result.latents.shape == expected.shape == (1, 4, 3, 2, 3)  # 48x32 pixels over the VAE's 16, 9 frames over 4
    assert_matches_reference(result.latents, expected)


def test_a_requests_own_size_matches_the_pipeline_told_that_size(released, pipe, monkeypatch):
    """height and width given (32x32, not the image's 48x32 bucket): the pipeline with its size choice
    returning them, the image cropped to them as it crops to a bucket; the folder's guidance scale."""
    monkeypatch.setattr(pipe.video_processor, "calculate_default_height_width", lambda height, width, target_size: (32, 32))
    args = dict(prompt="a red fox running through snow", negative_prompt="dark", num_inference_steps=2, num_frames=5)
    expected = pipe(image=_image(1), generator=torch.Generator().manual_seed(3), output_type="latent", **args).frames
    [result] = released.generate([Request(image=_image(1), seed=3, output_type="latent", height=32, width=32, **args)])
    assert result.ok, result.error
    assert released.loop.card.recipe.default_guidance_scale == GUIDANCE
    assert result.latents.shape == expected.shape == (1, 4, 2, 2, 2)
    assert_matches_reference(result.latents, expected)


def test_decoded_frames_match_the_pipelines(released, pipe):
    args = dict(prompt="a lighthouse at dusk", negative_prompt="fog", num_inference_steps=2, num_frames=5)
    expected = pipe(image=_image(2, 40, 64), generator=torch.Generator().manual_seed(5), output_type="np", **args).frames[0]
    [result] = released.generate([Request(image=np.asarray(_image(2, 40, 64)), seed=5, **args)])  # a uint8 array
    assert result.ok, result.error
    assert result.frames.shape == expected.shape and expected.shape[1] > expected.shape[2]  # a portrait bucket
    assert np.abs(result.frames.astype(int) - (expected * 255).round().astype(int)).max() <= 1


def test_the_image_to_video_forward_equals_the_transformers_bit_for_bit(released):
    """SigLIP tokens given: every image token valid, ahead of the ByT5 and Qwen tokens, as diffusers orders them."""
    transformer = released.loop.components.transformer
    g = torch.Generator().manual_seed(0)
    latents, image_embeds = torch.randn(2, 9, 3, 2, 3, generator=g), torch.randn(2, 16, 12, generator=g)
    text, glyph = torch.randn(2, 1000, 16, generator=g), torch.randn(2, 256, 32, generator=g)
    mask, glyph_mask = torch.zeros(2, 1000, dtype=torch.int64), torch.zeros(2, 256, dtype=torch.int64)
    mask[0, :30], mask[1, :7], glyph_mask[0, :12] = 1, 1, 1
    timestep = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        expected = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, encoder_attention_mask=mask.float(),
                               encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask.float(),
                               image_embeds=image_embeds, return_dict=False)[0]  # fmt: skip
        ours = HunyuanVideo15TextToVideo(transformer)(latents, timestep, text, mask, glyph, glyph_mask, image_embeds=image_embeds)[0]
    assert torch.equal(ours, expected)


def _mixed() -> list[Request]:
    """Other images (one a uint8 array), seeds, steps and guidance; one bucket, so one shape."""
    return [
        Request(image=_image(3), prompt='a sign saying "hi"', negative_prompt="blurry", guidance_scale=4.0, seed=1,
                num_inference_steps=3, num_frames=5, request_id="a", output_type="latent"),
        Request(image=np.asarray(_image(4, 90, 50)), prompt="a blue bird", guidance_scale=1.0, seed=2, num_inference_steps=2,
                num_frames=5, request_id="b", output_type="latent"),
        Request(image=_image(5), prompt="a cat", negative_prompt="dark", guidance_scale=7.0, seed=3, num_inference_steps=4,
                num_frames=5, request_id="c", output_type="latent"),
    ]  # fmt: skip


def test_interleaved_requests_equal_each_alone_bit_for_bit(released):
    together = {r.request_id: r for r in released.generate(_mixed())}
    for request in _mixed():
        [alone] = released.generate([request])
        assert together[request.request_id].ok and alone.ok, (together[request.request_id].error, alone.error)
        assert torch.equal(together[request.request_id].latents, alone.latents), request.request_id
    assert not torch.equal(together["a"].latents, together["c"].latents)


def test_compiled_equals_eager_and_a_second_wave_compiles_nothing(checkpoint, released):
    """-O1 (aot_eager: the CFG branches fused, the image's constants and the texts hoisted) against -O0;
    then other images, seeds, steps and scales at the same shape reuse every graph."""
    engine = Engine.from_card(CARD, checkpoint=checkpoint, device="cpu", dtype="fp32", opt_level=1,
                              compile_config=CompileConfig(backend="aot_eager"))  # fmt: skip
    first = engine.generate(_mixed())
    assert all(r.ok for r in first), [r.error for r in first]
    fused = {c.signature.step_kind: c.passes_changed.get("cfg_fusion", 0) for c in engine.compiler.compiled_steps}
    assert fused["denoise_cfg"] == 1, fused
    eager = {r.request_id: r for r in released.generate(_mixed())}
    for result in first:
        assert_within_compiled_noise(result.latents, eager[result.request_id].latents)
    compiles = engine.counters.snapshot()["compiles"]
    second = [r.model_copy(update={"image": _image(10 + i), "num_inference_steps": 2 + i, "seed": 40 + i,
                                   "guidance_scale": 1.0 if r.guidance_scale == 1.0 else 3.0 + i}) for i, r in enumerate(_mixed())]  # fmt: skip
    assert all(r.ok for r in engine.generate(second))
    assert engine.counters.snapshot()["compiles"] == compiles


def _parity_requests() -> list[Request]:
    return [Request(image=_image(7), prompt='a sign saying "hi"', negative_prompt="blurry", guidance_scale=4.0, seed=1,
                    num_inference_steps=2, num_frames=5),
            Request(image=_image(8), prompt="a blue bird", guidance_scale=1.0, seed=2, num_inference_steps=2, num_frames=5)]  # fmt: skip


@pytest.mark.parametrize("level", [1, 2])
def test_compiled_taps_equal_eager_within_the_card_tolerance(level):
    """-O1 / -O2 (aot_eager) against -O0 on tiny-hunyuanvideo1.5-i2v, tap by tap (the blocks see the image tokens)."""
    report = compare("tiny-hunyuanvideo1.5-i2v", _parity_requests(), Setting(0), Setting(level, backend="aot_eager"))
    assert report.passed, report.first_divergence
    assert {c.tap for c in report.comparisons} >= {"tap.noise", "tap.latents", "tap.block.1.0", "tap.block.1.1"}


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_on_a_gpu():
    """-O2 with inductor on CUDA (the fused CFG step with the image's constants captured as a CUDA graph) against -O0 on CUDA."""
    report = compare("tiny-hunyuanvideo1.5-i2v", _parity_requests(), Setting(0), Setting(2), device="cuda")
    assert report.passed, report.first_divergence


@pytest.mark.parametrize("steps_before_save", [1, 2, 3])
def test_a_state_saved_before_or_after_its_image_encodes_resumes_bit_for_bit(tmp_path, checkpoint, released, steps_before_save):
    """Saved after the text encode (SigLIP's pixels pending), after SigLIP (the VAE's image pending) or after the VAE."""
    request = Request(image=_image(6), prompt="a paper boat", negative_prompt=" ", guidance_scale=3.0, seed=9, num_inference_steps=2,
                      num_frames=5, output_type="latent")  # fmt: skip
    uninterrupted = released.generate([request])[0]
    state = released.start(request)
    for _ in range(steps_before_save):
        released.step(state)
    state.save(tmp_path / "state.pt")
    resumed = released.finish(released.resume(HunyuanVideo15I2VState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, uninterrupted.latents)


@pytest.mark.parametrize(
    "fields,name,rule",
    [
        (dict(), "image", "generates video from an image"),
        (dict(image=_image(0), height=32), "width", "give both, or neither"),
        (dict(image=_image(0), height=1296, width=48), "height", "exceeds"),
        (dict(image=_image(0), rollout={"noise_level": 0.7}), "rollout", "single-expert text-to-video"),
    ],
)
def test_bad_image_requests_are_refused_naming_the_field(released, fields, name, rule):
    with pytest.raises(RequestRejected, match=rule) as refused:
        released.loop.check_request(Request(prompt="x", **fields))
    assert refused.value.field == name


def test_the_text_to_video_card_refuses_an_image():
    engine = Engine.from_card("tiny-hunyuanvideo1.5", device="cpu")
    with pytest.raises(RequestRejected, match="takes no image"):
        engine.loop.check_request(Request(prompt="x", image=_image(0)))


def test_a_meanflow_transformer_is_refused_at_build():
    """HunyuanVideo-1.5's MeanFlow distills take the next timestep as well (timestep_r): not run here."""
    card = get_card("tiny-hunyuanvideo1.5-i2v")
    spec = card.components["transformer"]
    card = card.model_copy(update={"components": {**card.components, "transformer": spec.model_copy(
        update={"config": {**spec.config, "use_meanflow": True}})}})  # fmt: skip
    with pytest.raises(CheckpointError, match="use_meanflow=True"):
        HunyuanVideo15ImageToVideoLoop(card, load_components(card, None, torch.device("cpu")))
