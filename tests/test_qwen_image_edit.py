"""Qwen-Image-Edit (card qwen-image-edit, embedded tiny-qwen-image-edit): equal to diffusers'
QwenImageEditPipeline on a checkpoint written by its own save_pretrained, with and without true CFG and
a conditioning image of another size than the output; -O1 equals -O0 within the compiled tolerance and a
second wave compiles nothing; two edits of other images, seeds and steps in one generate() each equal
themselves alone bit for bit; bad requests are refused naming the field."""

import pytest
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.loops.qwen_image_edit_loop import QwenEditState
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from qwen_edit_checkpoint import edit_image as _image
from qwen_edit_checkpoint import edit_reference_pipeline, save_tiny_edit_checkpoint
from reference_helpers import REFERENCE_TOLERANCE, assert_matches_reference, assert_shares_no_storage, assert_within_compiled_noise


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_edit_checkpoint(tmp_path_factory.mktemp("tiny-qwen-image-edit"))


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return edit_reference_pipeline(checkpoint)


@pytest.fixture(scope="module")
def released(checkpoint):
    return Engine.from_card("qwen-image-edit", checkpoint=checkpoint, device="cpu", dtype="fp32")  # a bf16 release


CASES = {
    # a wide image: resized to 800 x 1312 for the VAE and the vision-language encoder, the output 48 x 64
    "no guidance": dict(prompt="make it winter", true_cfg_scale=1.0, num_inference_steps=2, height=48, width=64, image=(1, 300, 500)),
    "true cfg, a tall image": dict(prompt="make it winter", negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=2,
                                   height=64, width=32, image=(2, 500, 260)),
    # no size: the output at the image's edit size too, 1408 x 736
    "no size, a tall image": dict(prompt="make it winter", true_cfg_scale=1.0, num_inference_steps=2, image=(3, 500, 260)),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_edit_on_a_diffusers_checkpoint_matches_qwen_image_edit_pipeline(released, pipe, case):
    assert_shares_no_storage(released, pipe)
    args = dict(CASES[case])
    image = _image(*args.pop("image"))
    packed = pipe(image=image, generator=torch.Generator().manual_seed(7), output_type="latent", **args).images
    width, height, _ = calculate_dimensions(1024 * 1024, image.width / image.height)  # the pipeline's size without one
    reference = QwenImagePipeline._unpack_latents(packed, args.get("height", height), args.get("width", width), pipe.vae_scale_factor)
    [result] = released.generate([Request(image=image, seed=7, output_type="latent", **args)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)
    if case == "no guidance":
        [other] = released.generate([Request(image=_image(9, 300, 500), seed=7, output_type="latent", **args)])
        # Another image of the same size moves the result (by 1.5e-3: tiny random weights attend little to
        # it), fifty times the reference tolerance: an edit that ignored its image would fail.
        assert (other.latents - result.latents).abs().max() > 30 * REFERENCE_TOLERANCE.atol


def _requests(steps: tuple[int, int] = (2, 3), scales: tuple[float, float] = (3.0, 2.0)) -> list[Request]:
    """Two edits of one shape (images of one aspect ratio resize alike), other images, seeds, steps and scales."""
    return [Request(prompt="add a hat", negative_prompt="dark", true_cfg_scale=scales[0], image=_image(3, 64, 96), seed=1,
                    num_inference_steps=steps[0], height=32, width=48, output_type="latent", request_id="a"),
            Request(prompt="make it night", negative_prompt="day", true_cfg_scale=scales[1], image=_image(4, 128, 192), seed=2,
                    num_inference_steps=steps[1], height=32, width=48, output_type="latent", request_id="b")]  # fmt: skip


def test_interleaved_edits_equal_each_alone_and_compiled_equals_eager():
    eager = Engine.from_card("tiny-qwen-image-edit", device="cpu")
    alone = {r.request_id: eager.generate([r])[0].latents for r in _requests()}
    together = {r.request_id: r.latents for r in eager.generate(_requests())}
    assert all(torch.equal(alone[key], together[key]) for key in alone)
    compiled = Engine.from_card("tiny-qwen-image-edit", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                buckets=BucketSpec(batch_sizes=(2,)))  # fmt: skip
    first = compiled.generate(_requests())
    assert all(r.ok for r in first), [r.error for r in first]
    for result in first:
        assert_within_compiled_noise(result.latents, alone[result.request_id])
    compiles = compiled.counters.compiles
    assert compiled.counters.batches < compiled.counters.compiled_steps  # the two ran as one batch
    second = compiled.generate(_requests(steps=(3, 2), scales=(5.0, 1.5)))  # other steps and scales: the same graphs
    assert all(r.ok for r in second) and compiled.counters.compiles == compiles


@pytest.mark.parametrize(
    "fields,name,rule",
    [
        (dict(), "image", "edits an image"),
        (dict(image=_image(0, 32, 32), max_sequence_length=512), "max_sequence_length", "cuts no text"),
        (dict(image=_image(0, 32, 32), prompt="a <|image_pad|> here"), "prompt", "must not contain"),
        (dict(image=_image(0, 32, 32), guidance_scale=3.5), "guidance_scale", "no guidance input"),
        (dict(image=_image(0, 32, 32), prompt="x" * 900), "prompt", "past the text length of card 'tiny-qwen-image-edit' (1024)"),
        (dict(image=_image(0, 32, 32), negative_prompt="x" * 900, true_cfg_scale=2.0), "negative_prompt", "past the text length"),
        (dict(image=_image(0, 32, 32), auto_resize=False), "auto_resize", "takes no auto_resize"),  # FLUX.1 Kontext's field
        # no denoiser sections, as on Qwen-Image: step caching is refused, not run as an unknown sections layout
        (dict(image=_image(0, 32, 32), cache="fbcache"), "cache", "runs loop 'qwen_image_edit', which has no step caching yet"),
    ],
)
def test_bad_edit_requests_are_refused_naming_the_field(tiny_edit, fields, name, rule):
    [result] = tiny_edit.generate([Request(**{"prompt": "x", "num_inference_steps": 2, **fields})])
    assert result.status == "rejected" and result.error.startswith(f"{name}:") and rule in result.error, result.error


@pytest.mark.parametrize("steps_before_save", [0, 2])
def test_an_edit_saved_mid_run_resumes_bit_for_bit(tmp_path, tiny_edit, steps_before_save):
    """Saved before the text encode (the image's patches pending) or after the VAE encode (its latents kept)."""
    request = Request(prompt="a paper boat", negative_prompt=" ", true_cfg_scale=2.0, image=_image(6, 40, 40), seed=9,
                      num_inference_steps=2, height=32, width=32, output_type="latent")  # fmt: skip
    uninterrupted = tiny_edit.generate([request])[0]
    state = tiny_edit.start(request)
    for _ in range(steps_before_save):
        tiny_edit.step(state)
    assert (state.pixel_values is not None) == (steps_before_save == 0) and (state.condition is not None) == (steps_before_save == 2)
    state.save(tmp_path / "state.pt")
    fresh = Engine.from_card("tiny-qwen-image-edit", device="cpu")
    resumed = fresh.finish(fresh.resume(QwenEditState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, uninterrupted.latents)


def test_a_denoise_step_declares_the_joined_image_tokens_in_its_attention_shape(tiny_edit):
    """What the compiler picks attention backends by: text, latents and the edited image's tokens (a 32 x 32
    image resizes to 1024 x 1024: 64 x 64 packed tokens)."""
    state = tiny_edit.start(Request(prompt="a fox", image=_image(0, 32, 32), num_inference_steps=2, height=32, width=48))
    tiny_edit.step(state)
    tiny_edit.step(state)  # text encode, VAE encode
    plan = tiny_edit.loop.next(state)
    step = tiny_edit.loop.build_steps()[plan.kind]
    assert step.attention_shape(plan.inputs)[0] == state.prompt_embeds.shape[1] + 2 * 3 + 64 * 64


def test_a_saved_edit_whose_patches_do_not_fit_its_grid_is_refused(tiny_edit):
    state = tiny_edit.start(Request(prompt="a fox", image=_image(0, 32, 32), num_inference_steps=2))
    state.pixel_values = state.pixel_values[:, 1:]
    with pytest.raises(ValueError, match="pixel_values: must be"):
        tiny_edit.resume(state)


@pytest.fixture(scope="module")
def tiny_edit():
    return Engine.from_card("tiny-qwen-image-edit", device="cpu")
