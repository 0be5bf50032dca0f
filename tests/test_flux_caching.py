"""Step caching on FLUX through the same strategy files as Wan: FBCache, TaylorSeer and MagCache on
tiny FLUX equal diffusers' `enable_cache(...)` hooks on FluxPipeline with the same weights (latents,
and which denoiser calls ran their blocks) at two settings each that decide differently; the sections
equal the plain step bit for bit; cached and uncached FLUX requests together equal each alone; the
compiled caching steps equal eager; caching on Qwen-Image is refused naming the field. TeaCache on
FLUX: tests/test_flux_teacache.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from fvgraph.caching.fb_cache_steps import AFTER_FIRST_KINDS
from fvgraph.caching.mag_cache import MagCache
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request
from cache_helpers import flux_block_calls, run_recording_blocks, run_together_and_alone
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

STEPS = 10
PROMPT = {"prompt": "a red fox in snow", "guidance_scale": 3.5, "max_sequence_length": 32}  # embedded guidance, one branch (FLUX.1-dev)
TRUE_CFG = {**PROMPT, "negative_prompt": "blurry", "true_cfg_scale": 4.0}  # two branches, decided apart
SHAPE = {"height": 64, "width": 64, "num_inference_steps": STEPS}
# On tiny-flux (seed 5) diffusers' FBCache hooks run the later blocks in 8 of 10 calls at 0.25 (16 of
# 20 with true CFG) and in 4 of 10 at 0.35 (7 of 20, where at step 4 the cond branch computes while the
# uncond branch reuses).
FB_THRESHOLDS = (0.25, 0.35)
TAYLOR = {
    "first_order": {"cache_interval": 3, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32"},
    "second_order_cooldown": {"cache_interval": 4, "disable_cache_before_step": 3, "disable_cache_after_step": 9,
                              "max_order": 2, "taylor_factors_dtype": "float32"},  # fmt: skip
}
MAG = {"max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card("tiny-flux", device="cpu")


def _pipeline(card):
    """FluxPipeline on a fresh copy of the card's seeded weights: nothing of fvgraph in them."""
    c = load_components(card, None, torch.device("cpu"))
    parts = {name: module for name, module in c.modules().items()
             if name in ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")}  # fmt: skip
    pipe = FluxPipeline(scheduler=diffusers_scheduler(card.recipe.sampler), **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(engine, config, text: dict) -> tuple[torch.Tensor, list[bool]]:
    pipe = _pipeline(engine.card)
    pipe.transformer.enable_cache(config)
    calls, handles = flux_block_calls(pipe.transformer)
    try:
        packed = pipe(generator=torch.Generator().manual_seed(5), output_type="latent", **text, **SHAPE).images
    finally:
        for handle in handles:
            handle.remove()
    return FluxPipeline._unpack_latents(packed, SHAPE["height"], SHAPE["width"], pipe.vae_scale_factor).unsqueeze(2), calls


def _ours(engine, cache: dict, text: dict):
    """The result, and per denoiser call whether its blocks ran (tests/cache_helpers.py)."""
    request = Request(seed=5, output_type="latent", cache=cache, **text, **SHAPE)
    return run_recording_blocks(engine, request, fbcache=cache["method"] == "fbcache")


@pytest.mark.parametrize("text", [PROMPT, TRUE_CFG], ids=["guidance", "true_cfg"])
def test_fbcache_matches_diffusers_first_block_cache_at_two_thresholds(engine, text):
    counts = []
    for threshold in FB_THRESHOLDS:
        reference, theirs = _reference(engine, FirstBlockCacheConfig(threshold=threshold), text)
        result, ours = _ours(engine, {"method": "fbcache", "threshold": threshold}, text)
        calls = len(theirs)
        assert calls == STEPS * (2 if "true_cfg_scale" in text else 1)
        assert ours == theirs  # the same denoiser calls ran their later blocks
        assert {k: result.cache[k] for k in ("computed", "reused")} == {"computed": sum(theirs), "reused": calls - sum(theirs)}
        assert_matches_reference(result.latents, reference)
        counts.append(sum(theirs))
        last = theirs
    assert counts[0] > counts[1] >= 1  # the thresholds decide differently
    if "true_cfg_scale" in text:
        assert any(cond != uncond for cond, uncond in zip(last[::2], last[1::2]))  # the branches decided apart


@pytest.mark.parametrize("name", sorted(TAYLOR))
def test_taylorseer_matches_diffusers_taylorseer(engine, name):
    settings = TAYLOR[name]
    config = TaylorSeerCacheConfig(use_lite_mode=True, **{**settings, "taylor_factors_dtype": torch.float32})
    reference, theirs = _reference(engine, config, TRUE_CFG)
    result, ours = _ours(engine, {"method": "taylorseer", **settings}, TRUE_CFG)
    assert len(theirs) == 2 * STEPS and 0 < sum(theirs) < 2 * STEPS
    assert ours == [True] * sum(theirs)  # a forecast step runs no transformer at all
    assert {k: result.cache[k] for k in ("computed", "reused")} == {"computed": sum(theirs), "reused": 2 * STEPS - sum(theirs)}
    assert_matches_reference(result.latents, reference)


@pytest.mark.parametrize("threshold", [0.06, 0.04])
def test_magcache_matches_diffusers_magcache(engine, threshold):
    reference, theirs = _reference(engine, MagCacheConfig(threshold=threshold, num_inference_steps=STEPS, **MAG), PROMPT)
    cache = {"method": "magcache", "threshold": threshold, **MAG}
    result, ours = _ours(engine, cache, PROMPT)
    expected = MagCache(Request(prompt="x", cache=cache).cache, STEPS).schedule(STEPS)
    assert not all(expected) and any(expected)
    assert ours == theirs == expected  # the same denoiser calls ran their blocks, in the same order
    assert_matches_reference(result.latents, reference)


def test_a_cache_that_never_reuses_equals_the_plain_step_bit_for_bit(engine):
    """The sections (embed, blocks, stream, project_out) run FluxTransformer2DModel's forward line for line."""
    never = {"method": "magcache", "threshold": 0.06, **MAG, "max_skip_steps": 0}
    requests = [Request(seed=3, output_type="latent", cache=cache, **TRUE_CFG, **SHAPE) for cache in (never, None)]
    cached, plain = engine.generate(requests)
    assert cached.ok and plain.ok and cached.cache["reused"] == 0
    assert torch.equal(cached.latents, plain.latents)


def test_cached_and_uncached_flux_requests_together_equal_each_alone(engine):
    requests = [
        Request(seed=1, cache={"method": "fbcache", "threshold": 0.3}, **PROMPT, **SHAPE),
        Request(seed=2, **TRUE_CFG, **SHAPE),
        Request(seed=3, cache={"method": "taylorseer", **TAYLOR["first_order"]}, **TRUE_CFG, **SHAPE),
        Request(seed=4, cache={"method": "fbcache", "threshold": 0.5}, prompt="a blue bird", guidance_scale=2.0,
                height=64, width=64, num_inference_steps=6),
        Request(seed=5, cache={"method": "magcache", "threshold": 0.06, **MAG}, **PROMPT, **SHAPE),
    ]  # fmt: skip
    requests = [r.model_copy(update={"output_type": "latent"}) for r in requests]
    run_together_and_alone(engine, requests)


def test_compiled_caching_steps_equal_eager():
    compiled_engine = Engine.from_card("tiny-flux", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"))
    eager_engine = Engine.from_card("tiny-flux", device="cpu")
    requests = [Request(seed=7, output_type="latent", cache={"method": "fbcache", "threshold": 0.3}, **TRUE_CFG, **SHAPE),
                Request(seed=8, output_type="latent", cache={"method": "taylorseer", **TAYLOR["first_order"]}, **PROMPT, **SHAPE)]  # fmt: skip
    compiled = compiled_engine.generate(requests)  # captured with fullgraph: a graph break fails here
    kinds = {s.step_kind for s in compiled_engine.compiler.signatures}
    assert kinds & set(AFTER_FIRST_KINDS.values()) and "denoise_taylor_predict" in kinds
    for ours, theirs in zip(compiled, eager_engine.generate(requests)):
        assert ours.ok, ours.error
        assert ours.cache == theirs.cache
        assert_within_compiled_noise(ours.latents, theirs.latents)


def test_caching_on_qwen_image_is_refused_naming_the_field():
    qwen = Engine.from_card("tiny-qwen-image", device="cpu")
    [refused] = qwen.generate([Request(prompt="a cat", cache={"method": "fbcache"}, height=64, width=64, num_inference_steps=2)])
    assert refused.status == "rejected" and "has no step caching yet" in refused.error
