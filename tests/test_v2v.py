"""Video-to-video on Wan's text-to-video cards (Request(video=..., strength=...)): equal to diffusers'
WanVideoToVideoPipeline on a checkpoint it wrote itself; the video and strength validated naming them;
interleaved with text-to-video requests, resumed mid-way, and encoded in tiles."""

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import WanVideoToVideoPipeline
from pydantic import ValidationError

from conftest import embeds
from fvgraph.cards import get_card
from fvgraph.contract.phase import Phase
from fvgraph.engine.engine import Engine
from fvgraph.loops.samplers import start_step
from fvgraph.loops.t2v_loop import T2VState
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request, RequestRejected
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

SHAPE = {"height": 48, "width": 64, "num_inference_steps": 5}


def _video(seed: int, frames: int = 5, h: int = 40, w: int = 56) -> list[PIL.Image.Image]:
    """Frames of another size than the output: the pipeline resizes them, and so must the engine."""
    pixels = np.random.default_rng(seed).integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
    return [PIL.Image.fromarray(frame) for frame in pixels]


@pytest.fixture(scope="module")
def v2v_checkpoint(tmp_path_factory):
    """tiny-wan's seeded weights written by diffusers' own WanVideoToVideoPipeline."""
    card = get_card("tiny-wan")
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(WanVideoToVideoPipeline, c, tmp_path_factory.mktemp("tiny-v2v-checkpoint"),
                          scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip


@pytest.mark.parametrize("guidance_scale,strength", [(5.0, 0.7), (1.0, 0.5), (5.0, 1.0)])
def test_released_card_on_a_diffusers_checkpoint_matches_wan_video_to_video_pipeline(v2v_checkpoint, guidance_scale, strength):
    engine = Engine.from_card("wan2.1-t2v-1.3b", checkpoint=v2v_checkpoint, device="cpu", dtype="fp32")
    pipe = reference_pipeline(WanVideoToVideoPipeline, v2v_checkpoint, scheduler=diffusers_scheduler(engine.card.recipe.sampler))
    assert_shares_no_storage(engine, pipe)
    g = torch.Generator().manual_seed(21)
    positive, negative = (torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(2))
    video = _video(1)
    reference = pipe(
        video=video, prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale,
        strength=strength, generator=torch.Generator().manual_seed(5), output_type="latent", **SHAPE,
    ).frames  # fmt: skip
    [result] = engine.generate([Request(video=video, strength=strength, prompt_embeds=positive, negative_prompt_embeds=negative,
                                        guidance_scale=guidance_scale, seed=5, output_type="latent", **SHAPE)])  # fmt: skip
    assert result.ok, result.error
    assert result.timings.get("vae_encode", 0) > 0
    assert_matches_reference(result.latents, reference)


def test_the_untouched_video_differs_so_the_comparison_can_fail(tiny_engine):
    """Strength decides how much of the schedule runs: two strengths give different latents."""
    requests = [Request(prompt="a lighthouse", video=_video(2), strength=s, seed=3, output_type="latent", **SHAPE) for s in (0.4, 0.8)]
    low, high = tiny_engine.generate(requests)
    assert low.ok and high.ok
    assert not torch.allclose(low.latents, high.latents, atol=1e-3)


def test_strength_cuts_the_schedule_as_diffusers_get_timesteps():
    assert [start_step(10, s) for s in (1.0, 0.8, 0.7, 0.55, 0.1)] == [0, 2, 3, 5, 9]


def _requests(card):
    positive, negative = embeds(9, card)
    return [
        Request(prompt="a red fox", video=_video(4), strength=0.6, seed=1, num_inference_steps=5, height=48, width=64),
        Request(prompt="a lighthouse", seed=2, num_inference_steps=3, num_frames=5, height=48, width=64),
        Request(prompt_embeds=positive, negative_prompt_embeds=negative, video=_video(5, h=64, w=64), seed=3, guidance_scale=3.0,
                num_inference_steps=4, height=48, width=64),  # fmt: skip
    ]


def test_interleaved_with_text_to_video_equals_serial_and_a_saved_request_resumes(tmp_path, tiny_engine, tiny_card):
    serial = [tiny_engine.generate([r])[0] for r in _requests(tiny_card)]
    together = tiny_engine.generate(_requests(tiny_card))
    for alone, both in zip(serial, together):
        assert alone.ok and both.ok, (alone.error, both.error)
        assert torch.equal(alone.latents, both.latents) and (alone.frames == both.frames).all()
    for steps_before_save in (2, 3):  # after the video's encode, between denoise steps
        state = tiny_engine.start(_requests(tiny_card)[0])
        for _ in range(steps_before_save):
            tiny_engine.step(state)
        state.save(tmp_path / "v2v.pt")
        resumed = tiny_engine.finish(tiny_engine.resume(T2VState.load(tmp_path / "v2v.pt")))
        assert torch.equal(resumed.latents, serial[0].latents)
    state = tiny_engine.start(_requests(tiny_card)[0])
    assert state.schedule_start == 2 and state.num_steps == 3  # int(5 * 0.6) = 3 of 5 steps run
    state.schedule_start = 1
    with pytest.raises(ValueError, match="timesteps: is not the card's sampler schedule"):
        tiny_engine.resume(state)


def test_a_tiled_encode_equals_the_pipeline_with_enable_tiling(tmp_path):
    """The video encoded in tiles (vae_tiling) as diffusers' pipeline after vae.enable_tiling(same)."""
    tiling = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_sample_stride_height": 16, "tile_sample_stride_width": 16}
    card = get_card("tiny-wan")
    folder = saved_pipeline(WanVideoToVideoPipeline, load_components(card, None, torch.device("cpu")), tmp_path,
                            scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip
    engine = Engine.from_card("wan2.1-t2v-1.3b", checkpoint=folder, device="cpu", dtype="fp32", vae_tiling=tiling)
    pipe = reference_pipeline(WanVideoToVideoPipeline, folder, scheduler=diffusers_scheduler(engine.card.recipe.sampler))
    pipe.vae.enable_tiling(**tiling)
    positive = torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=torch.Generator().manual_seed(2))
    video = _video(7)
    reference = pipe(video=video, prompt_embeds=positive, guidance_scale=1.0, strength=0.8, generator=torch.Generator().manual_seed(4),
                     output_type="latent", **SHAPE).frames  # fmt: skip
    state = engine.start(Request(video=video, strength=0.8, prompt_embeds=positive, guidance_scale=1.0, seed=4,
                                 output_type="latent", **SHAPE))  # fmt: skip
    kinds = []
    while state.phase != Phase.DENOISE:
        kinds.append(engine.loop.next(state).kind)
        engine.step(state)
    assert kinds.count("vae_encode_tile") > 1 and kinds[-1] == "vae_encode_end" and "vae_encode" not in kinds
    assert_matches_reference(engine.finish(state).latents, reference)


@pytest.mark.parametrize(
    "fields,name,rule",
    [
        ({"strength": 0.0}, "strength", "greater than 0"),
        ({"strength": 1.5}, "strength", "less than or equal to 1"),
        ({"video": np.zeros((5, 8, 8, 4), np.uint8)}, "video", "3 channels"),
        ({"video": [np.zeros((8, 8, 3), np.uint8), np.zeros((8, 16, 3), np.uint8)]}, "video", "every frame must be one size"),
        ({"video": np.zeros((8, 8, 3), np.uint8)}, "video", r"\[T, H, W, 3\]"),
        ({"video": []}, "video", "1..1025"),
        ({"video": "clip.mp4"}, "video", "list of frames"),
    ],
)
def test_bad_video_fields_are_refused_naming_them(fields, name, rule):
    base = {"prompt": "a fox", "video": _video(0)}
    with pytest.raises(ValidationError, match=rule) as error:
        Request(**{**base, **fields})
    assert name in str(error.value)


@pytest.mark.parametrize(
    "fields,name,rule",
    [
        ({"video": _video(0, frames=6)}, "video", r"has 6 frames; .* k\*4\+1"),
        ({"video": _video(0), "num_frames": 9}, "video", "has 5 frames, num_frames is 9"),
        ({"strength": 0.5}, "strength", "give the video with it"),
        ({"video": _video(0), "strength": 0.1, "num_inference_steps": 5}, "strength", "runs none"),
        ({"video": _video(0), "cache": "fbcache"}, "cache", "without cache"),
    ],
)
def test_the_engine_refuses_a_video_request_it_cannot_serve_naming_the_field(tiny_engine, fields, name, rule):
    [result] = tiny_engine.generate([Request(prompt="a fox", **fields)])
    assert result.status == "rejected" and result.error.startswith(f"{name}:"), result.error
    assert __import__("re").search(rule, result.error), result.error


@pytest.mark.parametrize("card", ["tiny-wan2.2-a14b", "tiny-wan-i2v", "tiny-flux"])
def test_cards_without_video_to_video_refuse_the_video(card):
    engine = Engine.from_card(card, device="cpu")
    extra = {"image": _video(0)[0]} if card == "tiny-wan-i2v" else {}
    [result] = engine.generate([Request(prompt="a fox", video=_video(0), num_inference_steps=2, **extra)])
    assert result.status == "rejected" and result.error.startswith("video:"), result.error
    assert "takes no video" in result.error
