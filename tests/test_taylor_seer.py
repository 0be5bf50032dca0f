"""TaylorSeer as an interceptor: settings validated, decisions and latents as diffusers' TaylorSeer hook
(lite mode, the one that acts on Wan) on the same weights, compiled equal to eager without a graph
break, and requests with different methods interleaved or resumed unchanged."""

import pytest
import torch
from diffusers import WanPipeline
from diffusers.hooks import TaylorSeerCacheConfig
from pydantic import ValidationError

from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.models.components import diffusers_scheduler
from fvgraph.loops.t2v_loop import T2VState
from fvgraph.request import Request
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from cache_helpers import block_calls as _block_calls, run_together_and_alone
from conftest import embeds
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

STEPS = 10
SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": STEPS}
# Two settings with different schedules; float32 factors, so both sides forecast from the same numbers
# (with bfloat16 ones a last-bit difference in a feature can round one factor a bfloat16 step apart).
SETTINGS = {
    "first_order": {"cache_interval": 3, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32"},
    "second_order_cooldown": {"cache_interval": 4, "disable_cache_before_step": 3, "disable_cache_after_step": 9,
                              "max_order": 2, "taylor_factors_dtype": "float32"},  # fmt: skip
}
C, F = True, False
SCHEDULES = {"first_order": [C, C, F, C, F, F, C, F, F, C], "second_order_cooldown": [C, C, C, F, C, F, F, F, C, C]}


def _cache(name: str) -> dict:
    return {"method": "taylorseer", **SETTINGS[name]}


def _request(seed: int, cache: dict | None, guidance_scale: float = 5.0) -> Request:
    positive, negative = embeds(seed, get_card("tiny-wan"))
    return Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale, seed=seed,
                   output_type="latent", cache=cache, **SHAPE)  # fmt: skip



def test_taylorseer_settings_are_validated_naming_the_field():
    with pytest.raises(ValidationError, match=r"cache.disable_cache_before_step: Input should be greater than or equal to 1"):
        Request(prompt="x", cache={"method": "taylorseer", "disable_cache_before_step": 0})
    with pytest.raises(ValidationError, match=r"disable_cache_after_step=2 must be >= disable_cache_before_step=3"):
        Request(prompt="x", cache={"method": "taylorseer", "disable_cache_after_step": 2})
    with pytest.raises(ValidationError, match=r"cache.max_order: Input should be less than or equal to 4"):
        Request(prompt="x", cache={"method": "taylorseer", "max_order": 5})
    with pytest.raises(ValidationError, match=r"cache.taylor_factors_dtype: Input should be 'bfloat16', 'float16' or 'float32'"):
        Request(prompt="x", cache={"method": "taylorseer", "taylor_factors_dtype": "int8"})
    with pytest.raises(ValidationError, match=r"cache.use_lite_mode: Extra inputs are not permitted"):
        Request(prompt="x", cache={"method": "taylorseer", "use_lite_mode": True})
    defaults = Request(prompt="x", cache={"method": "taylorseer"}).cache  # diffusers' TaylorSeerCacheConfig defaults
    theirs = TaylorSeerCacheConfig()
    assert (defaults.cache_interval, defaults.disable_cache_before_step, defaults.disable_cache_after_step, defaults.max_order) == (
        theirs.cache_interval, theirs.disable_cache_before_step, theirs.disable_cache_after_step, theirs.max_order)  # fmt: skip
    assert defaults.taylor_factors_dtype == "bfloat16" and theirs.taylor_factors_dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_latents_and_full_calls_match_diffusers_taylorseer(tiny_engine, name):
    c = load_components(tiny_engine.card, None, torch.device("cpu"))  # the same weights, nothing of fvgraph in them
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(tiny_engine.card.recipe.sampler))  # fmt: skip
    config = {**SETTINGS[name], "taylor_factors_dtype": torch.float32}
    pipe.transformer.enable_cache(TaylorSeerCacheConfig(use_lite_mode=True, **config))
    request = _request(21, _cache(name))
    theirs, their_hooks = _block_calls(pipe.transformer)
    ours, our_hooks = _block_calls(tiny_engine.loop.components.transformer)
    try:
        reference = pipe(prompt_embeds=request.prompt_embeds[None], negative_prompt_embeds=request.negative_prompt_embeds[None],
                         guidance_scale=5.0, generator=torch.Generator().manual_seed(21), output_type="latent", **SHAPE).frames  # fmt: skip
        state = tiny_engine.start(request)
        schedule = state.caching.policy.schedule(STEPS)
        result = tiny_engine.finish(state)
    finally:
        for handle in their_hooks + our_hooks:
            handle.remove()
    assert result.ok, result.error
    assert schedule == SCHEDULES[name]
    expected = [step for step in schedule for _branch in ("cond", "uncond")]
    assert theirs == expected  # diffusers runs every call's embedders; its blocks ran at these calls only
    assert ours == [True] * sum(expected)  # a forecast step runs no transformer at all
    assert {k: result.cache[k] for k in ("method", "computed", "reused")} == {"method": "taylorseer", "computed": sum(expected), "reused": len(expected) - sum(expected)}
    assert_matches_reference(result.latents, reference)


def _mixed() -> list[Request]:
    teacache = {"method": "teacache", "threshold": 0.3, "coefficients": [0.25, 0.0]}
    return [_request(1, _cache("first_order")), _request(2, None), _request(3, _cache("second_order_cooldown")),
            _request(4, teacache), _request(5, {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}, 1.0)]  # fmt: skip


def test_taylorseer_teacache_and_uncached_requests_together_equal_each_alone(tiny_engine):
    requests = _mixed()
    together = run_together_and_alone(tiny_engine, requests)
    # no CFG, bfloat16 factors, refresh every other step after step 0: one call per step
    assert {k: together[4].cache[k] for k in ("method", "computed", "reused")} == {"method": "taylorseer", "computed": 5, "reused": 5}


def test_compiled_taylorseer_steps_equal_eager_and_add_no_recompile(tiny_engine):
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="aot_eager"))
    requests = [_request(1, _cache("first_order"))]  # its forecasts all have two orders: two kinds, two compiles
    compiled = engine.generate(requests)  # captured with fullgraph: a graph break would fail here
    with engine.counters.expect(compiles=0):
        again = engine.generate(requests)
    assert {s.step_kind for s in engine.compiler.signatures} == {"denoise_cfg_taylor_keep", "denoise_cfg_taylor_predict"}
    eager = tiny_engine.generate(requests)
    for a, b, c in zip(compiled, again, eager):
        assert a.ok and b.ok and a.cache == c.cache
        assert_within_compiled_noise(a.latents, c.latents)
        assert torch.equal(a.latents, b.latents)


def test_a_state_saved_between_a_forecast_and_a_refresh_resumes_unchanged(tiny_engine, tmp_path):
    request = _request(9, _cache("second_order_cooldown"))
    [whole] = tiny_engine.generate([request])
    state = tiny_engine.start(request)
    while state.step_index < 4:  # steps 0-2 computed, step 3 forecast: three orders of factors per branch held
        tiny_engine.step(state)
    assert len(state.caching.kept) == 2 * 3 and state.caching.memo == {"last": 2, "orders": 3}
    state.save(tmp_path / "state.pt")
    resumed = tiny_engine.finish(tiny_engine.resume(T2VState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, whole.latents)
    assert resumed.cache == whole.cache
    broken = T2VState.load(tmp_path / "state.pt")
    broken.caching.kept = broken.caching.kept[:-1]
    with pytest.raises(ValueError, match=r"caching.kept: must hold 0 or 6 tensors \(3 per CFG branch\), got 5"):
        tiny_engine.resume(broken)
    broken.caching.memo = {"last": 2, "orders": 7}
    with pytest.raises(ValueError, match=r"caching.memo: orders=7 must be an int in \[0, max_order \+ 1 = 3\]"):
        tiny_engine.resume(broken)


@pytest.mark.gpu
def test_taylorseer_and_teacache_graphed_on_cuda_equal_cuda_eager(tiny_card):
    """-O2 (inductor, CUDA graphs): the keep, reuse and forecast kinds each replay their own graphs."""
    requests = _mixed()[:4]
    eager = Engine.from_card("tiny-wan", device="cuda").generate(requests)
    graphs = Engine.from_card("tiny-wan", device="cuda", opt_level=2, compile_config=CompileConfig(backend="inductor"))
    first = graphs.generate(requests)
    with graphs.counters.expect(compiles=0, captures=0):
        again = graphs.generate(requests)
    assert graphs.counters.replays > 0
    for a, b, c in zip(first, again, eager):
        assert a.ok and b.ok and c.ok, (a.error, b.error, c.error)
        assert a.cache == c.cache
        assert_within_compiled_noise(a.latents, c.latents)
        assert torch.equal(a.latents, b.latents)
