"""Wan 2.1 image-to-video: the released card loads a tiny checkpoint written by diffusers'
WanImageToVideoPipeline and matches that pipeline; the image is validated; the loop interleaves,
resumes and compiles like any other."""

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from pydantic import ValidationError

from fvgraph.models.components import load_components
from fvgraph.cards import get_card
from fvgraph.engine.engine import Engine
from fvgraph.loops.i2v_loop import I2VState
from fvgraph.parity import Setting, compare
from fvgraph.request import Request
from fvgraph.models.components import diffusers_scheduler
from conftest import embeds
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

SHAPE = {"height": 48, "width": 64, "num_frames": 5, "num_inference_steps": 3}


def _image(seed: int, h: int = 40, w: int = 56) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny_i2v():
    return Engine.from_card("tiny-wan-i2v", device="cpu")


@pytest.fixture(scope="module")
def i2v_checkpoint(tmp_path_factory):
    """tiny-wan-i2v's seeded weights written by diffusers' own pipeline class."""
    card = get_card("tiny-wan-i2v")
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(WanImageToVideoPipeline, c, tmp_path_factory.mktemp("tiny-i2v-checkpoint"),
                          scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])
def test_released_card_on_a_diffusers_checkpoint_matches_wan_image_to_video_pipeline(i2v_checkpoint, guidance_scale):
    engine = Engine.from_card("wan2.1-i2v-14b-480p", checkpoint=i2v_checkpoint, device="cpu", dtype="fp32")  # a bf16 release
    pipe = reference_pipeline(WanImageToVideoPipeline, i2v_checkpoint, scheduler=diffusers_scheduler(engine.card.recipe.sampler))
    assert_shares_no_storage(engine, pipe)
    # Full-length embeddings (the card's text length, the checkpoint's width): diffusers uses short
    # ones as given, where Wan (and fvgraph) zero-pads them.
    g = torch.Generator().manual_seed(21)
    positive, negative = (torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(2))
    image = _image(1)
    reference = pipe(
        image=image, prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(5), output_type="latent", **SHAPE,
    ).frames  # fmt: skip
    [result] = engine.generate([Request(image=image, prompt_embeds=positive, negative_prompt_embeds=negative,
                                        guidance_scale=guidance_scale, seed=5, output_type="latent", **SHAPE)])  # fmt: skip
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)


@pytest.mark.parametrize(
    "image,rule",
    [
        (np.zeros((8, 8, 4), np.uint8), "3 channels"),
        (np.zeros((8, 8, 3), np.float32), "must be uint8"),
        (torch.full((3, 8, 8), float("nan")), "NaN or Inf"),
        (torch.full((3, 8, 8), 2.0), "values in [0, 1]"),
        (np.zeros((0, 8, 3), np.uint8), "each side must be within"),
        ("/no/such/file.png", "is not a file"),
        (42, "must be a path, PIL image"),
    ],
)
def test_bad_images_are_refused_naming_the_rule(image, rule):
    with pytest.raises(ValidationError) as info:
        Request(prompt="x", image=image)
    assert "image" in str(info.value) and rule in str(info.value)


def test_every_accepted_image_form_is_the_same_rgb_image(tmp_path):
    image = _image(3)
    image.save(tmp_path / "frame.png")
    pixels = np.array(image)
    forms = [image, image.convert("RGBA"), str(tmp_path / "frame.png"), pixels, torch.from_numpy(pixels),
             torch.from_numpy(pixels).permute(2, 0, 1), torch.from_numpy(pixels).float() / 255]  # fmt: skip
    for form in forms:
        assert np.array_equal(np.asarray(Request(prompt="x", image=form).image), pixels)


def test_the_image_is_required_here_and_refused_by_text_to_video(tiny_i2v, tiny_engine):
    [missing] = tiny_i2v.generate([Request(prompt="x", seed=0, num_inference_steps=1, num_frames=1)])
    assert missing.status == "rejected" and "image: card 'tiny-wan-i2v' generates video from an image" in missing.error
    [extra] = tiny_engine.generate([Request(prompt="x", image=_image(0), seed=0, num_inference_steps=1, num_frames=1)])
    assert extra.status == "rejected" and "loop 't2v', which takes no image" in extra.error


def _requests():
    pos, neg = embeds(9, get_card("tiny-wan-i2v"))
    return [
        Request(prompt="a lighthouse", image=_image(4), seed=1, num_inference_steps=3, num_frames=5, height=48, width=64),
        Request(prompt_embeds=pos, negative_prompt_embeds=neg, image=_image(5, 64, 64), seed=2, guidance_scale=3.0,
                num_inference_steps=2, num_frames=5, height=48, width=64),  # fmt: skip
    ]


def test_interleaved_equals_serial_and_a_saved_request_resumes(tmp_path, tiny_i2v):
    serial = [tiny_i2v.generate([r])[0] for r in _requests()]
    together = tiny_i2v.generate(_requests())
    for alone, both in zip(serial, together):
        assert alone.ok and both.ok
        assert torch.equal(alone.latents, both.latents) and (alone.frames == both.frames).all()
    for steps_before_save in (2, 3, 4):  # after image encode, after VAE encode, between denoise steps
        state = tiny_i2v.start(_requests()[0])
        for _ in range(steps_before_save):
            tiny_i2v.step(state)
        state.save(tmp_path / "i2v.pt")
        resumed = tiny_i2v.finish(tiny_i2v.resume(I2VState.load(tmp_path / "i2v.pt")))
        assert torch.equal(resumed.latents, serial[0].latents)
    assert set(serial[0].timings) >= {"text_encode", "image_encode", "vae_encode", "denoise", "vae_decode"}


def test_compiled_i2v_equals_eager_within_the_card_tolerance():
    """-O1 (aot_eager, CFG fusion and hoisting over the image inputs too) against -O0, tap by tap."""
    report = compare("tiny-wan-i2v", _requests(), Setting(0), Setting(1, backend="aot_eager"))
    assert report.passed, report.first_divergence
    assert {c.tap for c in report.comparisons} >= {"tap.noise", "tap.latents"}


def test_warmup_and_serve_run_the_i2v_card_through_the_cli(tmp_path):
    """`fvgraph warmup` builds its requests through the loop (an image included); `fvgraph serve`
    takes the image as a path in a JSON line."""
    import json

    from typer.testing import CliRunner

    from fvgraph.cli import app

    runner = CliRunner()
    warm = runner.invoke(app, ["warmup", "--card", "tiny-wan-i2v", "-O1", "--compile-backend", "aot_eager", "--buckets", "1",
                               "--shape", "5x48x64", "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    assert warm.exit_code == 0, warm.output
    assert "1 step graphs (1 compiled" in warm.output
    _image(6).save(tmp_path / "first.png")
    line = {"prompt": "a fox", "image": str(tmp_path / "first.png"), "seed": 0, "num_inference_steps": 2,
            "num_frames": 5, "height": 48, "width": 64, "request_id": "fox"}  # fmt: skip
    served = runner.invoke(app, ["serve", "--card", "tiny-wan-i2v", "-O0", "-o", str(tmp_path / "out")], input=json.dumps(line) + "\n")
    assert served.exit_code == 0, served.output
    [result] = [json.loads(s) for s in served.output.splitlines() if s.startswith("{")]
    assert result["request_id"] == "fox" and result["status"] == "ok", result


CACHE_STEPS = 8
MAG = {"max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": [1.0] + [0.99] * (CACHE_STEPS - 1)}


@pytest.mark.parametrize("method", ["fbcache", "magcache"])
def test_a_cached_request_equals_the_image_to_video_pipeline_under_diffusers_hook(i2v_checkpoint, method):
    """The caching steps' sections take the image as the plain step does (its latents and mask on the
    channels, its CLIP tokens beside the text): FBCache and MagCache on the released card equal
    WanImageToVideoPipeline with `transformer.enable_cache(...)`, the same count of denoiser calls
    running every block."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig

    cache, config = {
        "fbcache": ({"method": "fbcache", "threshold": 0.05}, FirstBlockCacheConfig(threshold=0.05)),
        "magcache": ({"method": "magcache", "threshold": 0.06, **MAG}, MagCacheConfig(threshold=0.06, num_inference_steps=CACHE_STEPS, **MAG)),
    }[method]  # fmt: skip
    engine = Engine.from_card("wan2.1-i2v-14b-480p", checkpoint=i2v_checkpoint, device="cpu", dtype="fp32")
    pipe = reference_pipeline(WanImageToVideoPipeline, i2v_checkpoint, scheduler=diffusers_scheduler(engine.card.recipe.sampler))
    pipe.transformer.enable_cache(config)
    ran: list[bool] = []  # per denoiser call: whether its last block ran
    pipe.transformer.blocks[0].register_forward_pre_hook(lambda m, a: ran.append(False))
    pipe.transformer.blocks[-1].attn1.register_forward_pre_hook(lambda m, a: ran.__setitem__(-1, True))
    g = torch.Generator().manual_seed(21)
    positive, negative = (torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(2))
    shape = {**SHAPE, "num_inference_steps": CACHE_STEPS}
    image = _image(1)
    reference = pipe(image=image, prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0,
                     generator=torch.Generator().manual_seed(5), output_type="latent", **shape).frames  # fmt: skip
    [result] = engine.generate([Request(image=image, prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0,
                                        seed=5, output_type="latent", cache=cache, **shape)])  # fmt: skip
    assert result.ok, result.error
    assert len(ran) == 2 * CACHE_STEPS and 0 < sum(ran) < 2 * CACHE_STEPS
    assert (result.cache["computed"], result.cache["reused"]) == (sum(ran), 2 * CACHE_STEPS - sum(ran))
    assert_matches_reference(result.latents, reference)
