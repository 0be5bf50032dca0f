"""Wan 2.2 TI2V-5B: the released card loads a tiny checkpoint written by diffusers' WanPipeline with
`expand_timesteps` and matches diffusers' pipelines on it, with and without a first frame; text-only
and image requests share one compiled step; the loop interleaves, resumes and runs through the CLI."""

import json
import re

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from typer.testing import CliRunner

from fvgraph.cards import get_card
from fvgraph.cli import app
from fvgraph.models.components import diffusers_scheduler
from fvgraph.loops.ti2v_loop import TI2VState
from fvgraph.parity import Setting, compare
from fvgraph.request import Request
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from conftest import embeds
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

CARD = "tiny-wan2.2-ti2v"
SHAPE = {"height": 64, "width": 96, "num_frames": 5, "num_inference_steps": 3}  # latents [1, 48, 2, 4, 6]


def _image(seed: int, h: int = 40, w: int = 56) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ti2v():
    return Engine.from_card(CARD, device="cpu")


@pytest.fixture(scope="module")
def ti2v_checkpoint(tmp_path_factory):
    """tiny-wan2.2-ti2v's seeded weights, written by diffusers' own WanPipeline."""
    card = get_card(CARD)
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(WanPipeline, c, tmp_path_factory.mktemp("tiny-ti2v-checkpoint"),
                          scheduler=diffusers_scheduler(card.recipe.sampler), expand_timesteps=True)  # fmt: skip


@pytest.fixture(scope="module")
def released(ti2v_checkpoint):
    """The released (bf16) card's engine, in fp32, on that checkpoint."""
    return Engine.from_card("wan2.2-ti2v-5b", checkpoint=ti2v_checkpoint, device="cpu", dtype="fp32")


def test_the_wan_2_2_vae_facts_come_from_the_checkpoint(released):
    facts = released.facts
    assert (facts.latent_channels, facts.denoiser_in_channels, facts.vae_spatial, facts.vae_temporal) == (48, 48, 16, 4)
    assert facts.spatial_multiple == 32  # 16x VAE compression, 2x2 patches
    [result] = released.generate([Request(prompt_embeds=torch.zeros(1, facts.text_dim), seed=0, height=48, width=64,
                                          num_frames=5, num_inference_steps=1, guidance_scale=1.0)])  # fmt: skip
    assert result.status == "rejected" and "height: 48 must be a multiple of 32" in result.error


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "text+image"])
def test_released_card_on_a_diffusers_checkpoint_matches_the_diffusers_pipelines(released, ti2v_checkpoint, with_image):
    """WanPipeline for text alone, WanImageToVideoPipeline for a first frame, both with expand_timesteps,
    loaded from the checkpoint apart from the engine."""
    pipe = reference_pipeline(WanPipeline, ti2v_checkpoint, scheduler=diffusers_scheduler(released.card.recipe.sampler))
    if with_image:  # the same loaded modules in the image pipeline
        pipe = WanImageToVideoPipeline(**pipe.components, expand_timesteps=pipe.config.expand_timesteps)
    assert pipe.config.expand_timesteps
    assert_shares_no_storage(released, pipe)
    image = {"image": _image(1)} if with_image else {}
    g = torch.Generator().manual_seed(21)  # full-length embeddings: diffusers does not pad short ones
    positive, negative = (torch.randn(1, released.card.shapes.text_len, released.facts.text_dim, generator=g) for _ in range(2))
    reference = pipe(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0,
                     generator=torch.Generator().manual_seed(5), output_type="latent", **image, **SHAPE).frames  # fmt: skip
    kinds = []
    [result] = released.generate([Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0, seed=5,
                                          output_type="latent", **image, **SHAPE)], on_step=lambda s, kind: kinds.append(kind))  # fmt: skip
    assert result.ok, result.error
    assert ("vae_encode" in kinds) == with_image
    assert_matches_reference(result.latents, reference)


def _requests():
    pos, neg = embeds(9, get_card(CARD))
    return [
        Request(prompt="a lighthouse", image=_image(4), seed=1, **SHAPE),
        Request(prompt_embeds=pos, negative_prompt_embeds=neg, seed=2, guidance_scale=3.0, num_inference_steps=2,
                height=64, width=96, num_frames=5),  # fmt: skip
    ]


def test_interleaved_equals_serial_and_a_saved_request_resumes(tmp_path, ti2v):
    serial = [ti2v.generate([r])[0] for r in _requests()]
    together = ti2v.generate(_requests())
    for alone, both in zip(serial, together):
        assert alone.ok and both.ok
        assert torch.equal(alone.latents, both.latents) and (alone.frames == both.frames).all()
    for steps_before_save in (1, 2, 3, 5):  # after text encode, after VAE encode, between denoise steps, before decode
        state = ti2v.start(_requests()[0])
        for _ in range(steps_before_save):
            ti2v.step(state)
        state.save(tmp_path / "ti2v.pt")
        resumed = ti2v.finish(ti2v.resume(TI2VState.load(tmp_path / "ti2v.pt")))
        assert torch.equal(resumed.latents, serial[0].latents) and (resumed.frames == serial[0].frames).all()
    assert set(serial[0].timings) >= {"text_encode", "vae_encode", "denoise", "vae_decode"}
    assert "vae_encode" not in serial[1].timings


def test_a_saved_state_with_a_bad_frame_mask_is_refused_naming_the_field(tmp_path, ti2v):
    state = ti2v.start(_requests()[1])
    ti2v.step(state)
    for bad, rule in ((state.frame_mask[:, :, :1], "frame_mask: must be a finite float tensor of shape [1, 1, 2, 4, 6]"),
                      (state.frame_mask * 0.5, "frame_mask: must hold only 0 and 1")):  # fmt: skip
        state.frame_mask = bad
        state.save(tmp_path / "bad.pt")
        with pytest.raises(ValueError, match=re.escape(rule)):
            ti2v.resume(TI2VState.load(tmp_path / "bad.pt"))


def test_compiled_equals_eager_and_text_and_image_requests_share_one_step_graph():
    """fvgraph.parity: -O1 (aot_eager) against -O0 tap by tap; both requests run the one CFG denoise signature."""
    compiled = []
    report = compare(CARD, _requests(), Setting(0), Setting(1, backend="aot_eager"), prepare_b=compiled.append)
    assert report.passed, report.first_divergence
    assert {c.tap for c in report.comparisons} >= {"tap.noise", "tap.latents"}
    assert [(s.step_kind, s.component) for s in compiled[0].compiler.signatures] == [("denoise_cfg", "transformer")]


def test_warmup_and_serve_run_the_card_through_the_cli(tmp_path):
    """`fvgraph warmup` compiles the one denoise step from the loop's warmup request; `fvgraph serve`
    takes a request with a first frame (a path) and one without."""
    runner = CliRunner()
    warm = runner.invoke(app, ["warmup", "--card", CARD, "-O1", "--compile-backend", "eager", "--buckets", "1",
                               "--shape", "5x64x64", "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    assert warm.exit_code == 0, warm.output
    assert "1 step graphs (1 compiled" in warm.output
    _image(6).save(tmp_path / "first.png")
    lines = [{"prompt": "a fox", "image": str(tmp_path / "first.png"), "request_id": "fox"}, {"prompt": "a hare", "request_id": "hare"}]
    shape = {"seed": 0, "num_inference_steps": 2, "num_frames": 5, "height": 64, "width": 64}
    served = runner.invoke(app, ["serve", "--card", CARD, "-O0", "-o", str(tmp_path / "out")],
                           input="".join(json.dumps({**line, **shape}) + "\n" for line in lines))  # fmt: skip
    assert served.exit_code == 0, served.output
    results = {r["request_id"]: r["status"] for r in (json.loads(s) for s in served.output.splitlines() if s.startswith("{"))}
    assert results == {"fox": "ok", "hare": "ok"}


@pytest.mark.gpu
def test_cuda_graphs_replay_text_and_image_requests_after_a_text_only_warmup():
    """-O2 on CUDA: the warmup (text only) captures the one denoise graph per bucket, and an image
    request then replays it with no compile and no capture, within the card's loop tolerance of eager."""
    from fvgraph.compile.compiler import CompileConfig
    from fvgraph.runtime.buckets import BucketSpec

    eager = Engine.from_card(CARD, device="cuda").generate(_requests())
    graphs = Engine.from_card(CARD, device="cuda", opt_level=2, compile_config=CompileConfig(backend="inductor"),
                              buckets=BucketSpec(batch_sizes=(1, 2)))  # fmt: skip
    graphs.warmup(_requests()[1:])
    with graphs.counters.expect(compiles=0, captures=0):
        replayed = graphs.generate(_requests())
    tol = graphs.card.parity.tolerance("fp32", "loop")
    for a, b in zip(eager, replayed):
        assert b.ok, b.error
        torch.testing.assert_close(b.latents, a.latents, atol=tol.atol, rtol=tol.rtol)


CACHE_STEPS = 8
MAG = {"max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": [1.0] + [0.99] * (CACHE_STEPS - 1)}


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "text+image"])
@pytest.mark.parametrize("method", ["fbcache", "magcache"])
def test_a_cached_request_equals_the_pipelines_under_diffusers_hook(released, ti2v_checkpoint, method, with_image):
    """The caching steps' sections take the given frame as the plain step does (its latents in place of
    the noise, those tokens at timestep 0): FBCache and MagCache equal WanPipeline (text) and
    WanImageToVideoPipeline (a first frame), both with expand_timesteps, under `transformer.enable_cache(...)`,
    the same count of denoiser calls running every block."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig

    cache, config = {
        "fbcache": ({"method": "fbcache", "threshold": 0.05}, FirstBlockCacheConfig(threshold=0.05)),
        "magcache": ({"method": "magcache", "threshold": 0.06, **MAG}, MagCacheConfig(threshold=0.06, num_inference_steps=CACHE_STEPS, **MAG)),
    }[method]  # fmt: skip
    pipe = reference_pipeline(WanPipeline, ti2v_checkpoint, scheduler=diffusers_scheduler(released.card.recipe.sampler))
    if with_image:
        pipe = WanImageToVideoPipeline(**pipe.components, expand_timesteps=pipe.config.expand_timesteps)
    pipe.transformer.enable_cache(config)
    ran: list[bool] = []  # per denoiser call: whether its last block ran
    pipe.transformer.blocks[0].register_forward_pre_hook(lambda m, a: ran.append(False))
    pipe.transformer.blocks[-1].attn1.register_forward_pre_hook(lambda m, a: ran.__setitem__(-1, True))
    image = {"image": _image(1)} if with_image else {}
    g = torch.Generator().manual_seed(21)
    positive, negative = (torch.randn(1, released.card.shapes.text_len, released.facts.text_dim, generator=g) for _ in range(2))
    shape = {**SHAPE, "num_inference_steps": CACHE_STEPS}
    reference = pipe(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0,
                     generator=torch.Generator().manual_seed(5), output_type="latent", **image, **shape).frames  # fmt: skip
    [result] = released.generate([Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0, seed=5,
                                          output_type="latent", cache=cache, **image, **shape)])  # fmt: skip
    assert result.ok, result.error
    assert len(ran) == 2 * CACHE_STEPS and 0 < sum(ran) < 2 * CACHE_STEPS
    assert (result.cache["computed"], result.cache["reused"]) == (sum(ran), 2 * CACHE_STEPS - sum(ran))
    assert_matches_reference(result.latents, reference)
