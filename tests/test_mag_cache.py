"""MagCache as an interceptor: settings validated, decisions and latents as diffusers' MagCache hooks
on the same weights, compiled equal to eager, and cached requests interleaved or resumed unchanged."""

import pytest
import torch
from diffusers import WanPipeline
from diffusers.hooks import MagCacheConfig
from diffusers.hooks.mag_cache import nearest_interp as diffusers_nearest_interp
from pydantic import ValidationError

from fvgraph.cards import get_card
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.caching.mag_cache import MagCache, MagCacheSettings, nearest_interp
from fvgraph.models.components import diffusers_scheduler
from fvgraph.loops.t2v_loop import T2VState
from fvgraph.request import Request, RequestRejected
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from cache_helpers import block_calls as _block_calls, run_together_and_alone
from conftest import embeds
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

STEPS = 10
SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": STEPS}
# tiny-wan's random weights have no calibrated ratios; these make the schedule mix both step kinds:
# at 0.06 the error stays under the threshold and max_skip_steps ends each run of reuses; at 0.04
# the threshold does.
RATIOS = [1.0] + [0.99] * (STEPS - 1)
MAG = {"max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": RATIOS}


def _cache(threshold: float, **overrides) -> dict:
    return {"method": "magcache", "threshold": threshold, **MAG, **overrides}


def _request(seed: int, cache: dict | None, guidance_scale: float = 5.0) -> Request:
    positive, negative = embeds(seed, get_card("tiny-wan"))
    return Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale, seed=seed,
                   output_type="latent", cache=cache, **SHAPE)  # fmt: skip


def _calls(result) -> dict:
    """What Result.cache says about denoiser calls (FLOPs aside: tests/test_step_flops.py)."""
    return {key: result.cache[key] for key in ("method", "computed", "reused")}


@pytest.mark.parametrize("length, steps", [(10, 10), (10, 4), (4, 10), (7, 1), (1, 5), (50, 13)])
def test_nearest_interp_equals_diffusers(length, steps):
    ratios = torch.linspace(1.2, 0.8, length)
    assert torch.equal(nearest_interp(ratios, steps), diffusers_nearest_interp(ratios, steps))


def test_cache_settings_are_validated_naming_the_field(tiny_card):
    with pytest.raises(ValidationError, match=r"cache.method='teacach' is not a known method; known methods: magcache"):
        Request(prompt="x", cache={"method": "teacach"})
    with pytest.raises(ValidationError, match=r"cache.tresh: Extra inputs are not permitted"):
        Request(prompt="x", cache={**_cache(0.06), "tresh": 0.1})
    with pytest.raises(ValidationError, match=r"cache.mag_ratios.1: Input should be greater than 0"):
        Request(prompt="x", cache=_cache(0.06, mag_ratios=[1.0, -0.5]))
    with pytest.raises(ValidationError, match=r"cache.threshold: Input should be a finite number"):
        Request(prompt="x", cache=_cache(float("nan")))
    with pytest.raises(ValidationError, match=r"cache must be a dict with a 'method' key"):
        Request(prompt="x", cache=["magcache"])
    request = Request(prompt="x", num_inference_steps=STEPS, cache=_cache(0.06, num_inference_steps=STEPS + 2))
    with pytest.raises(RequestRejected, match=f"cache.num_inference_steps: {STEPS + 2} differs") as err:
        request.resolve(tiny_card)
    assert err.value.field == "cache.num_inference_steps"
    resolved = Request(prompt="x", num_inference_steps=STEPS, cache=_cache(0.06)).resolve(tiny_card)
    assert isinstance(resolved.cache, MagCacheSettings) and resolved.cache.mag_ratios == tuple(RATIOS)


def test_schedule_follows_the_threshold_and_max_skip_steps():
    schedule = {t: MagCache(MagCacheSettings(**_cache(t)), STEPS).schedule(STEPS) for t in (0.06, 0.04)}
    C, R = True, False
    assert schedule[0.06] == [C, C, R, R, R, C, R, R, R, C]  # runs of 3 reuses end at max_skip_steps
    assert schedule[0.04] == [C, C, R, R, C, R, R, C, R, R]  # the error passes 0.04 at the third
    assert MagCache(MagCacheSettings(**_cache(0.06, max_skip_steps=0)), STEPS).schedule(STEPS) == [C] * STEPS


@pytest.mark.parametrize("threshold", [0.06, 0.04])
def test_latents_and_full_calls_match_diffusers_magcache(tiny_engine, threshold):
    c = load_components(tiny_engine.card, None, torch.device("cpu"))  # the same weights, nothing of fvgraph in them
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(tiny_engine.card.recipe.sampler))  # fmt: skip
    pipe.transformer.enable_cache(MagCacheConfig(threshold=threshold, num_inference_steps=STEPS, **MAG))
    request = _request(21, _cache(threshold))
    theirs, their_hooks = _block_calls(pipe.transformer)
    ours, our_hooks = _block_calls(tiny_engine.loop.components.transformer)
    try:
        reference = pipe(prompt_embeds=request.prompt_embeds[None], negative_prompt_embeds=request.negative_prompt_embeds[None],
                         guidance_scale=5.0, generator=torch.Generator().manual_seed(21), output_type="latent", **SHAPE).frames  # fmt: skip
        [result] = tiny_engine.generate([request])
    finally:
        for handle in their_hooks + our_hooks:
            handle.remove()
    assert result.ok, result.error
    expected = [step for step in MagCache(request.cache, STEPS).schedule(STEPS) for _branch in ("cond", "uncond")]
    assert not all(expected) and any(expected)
    assert ours == theirs == expected  # the same denoiser calls ran their blocks, in the same order
    assert _calls(result) == {"method": "magcache", "computed": sum(expected), "reused": len(expected) - sum(expected)}
    assert_matches_reference(result.latents, reference)


def test_a_cache_that_never_reuses_equals_no_cache_bit_for_bit(tiny_engine):
    """The full (keep) step runs diffusers' forward line for line: same latents as the plain step."""
    never = _cache(0.06, max_skip_steps=0)
    cached, plain = tiny_engine.generate([_request(5, never), _request(5, None)])
    assert _calls(cached) == {"method": "magcache", "computed": 2 * STEPS, "reused": 0}
    assert cached.cache["flops"] == cached.cache["flops_uncached"] > 0
    assert plain.cache is None
    assert torch.equal(cached.latents, plain.latents)


def _mixed() -> list[Request]:
    return [_request(1, _cache(0.06)), _request(2, None), _request(3, _cache(0.04)), _request(4, _cache(0.06), 1.0)]


def test_cached_and_uncached_requests_together_equal_each_alone(tiny_engine):
    requests = _mixed()
    together = run_together_and_alone(tiny_engine, requests)
    assert _calls(together[3]) == {"method": "magcache", "computed": 4, "reused": 6}  # no CFG: one call per step


def test_compiled_cached_steps_equal_eager_and_add_no_recompile(tiny_engine):
    # one batch bucket of 2: the groups of one request are padded, and one signature per kind covers the run
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="aot_eager"),
                              buckets=BucketSpec(batch_sizes=(2,)))  # fmt: skip
    requests = _mixed()
    compiled = engine.generate(requests)
    with engine.counters.expect(compiles=0):  # every (kind, batch) signature of this mix is compiled now
        again = engine.generate(requests)
    compiled_kinds = {signature.step_kind for signature in engine.compiler.signatures}
    assert compiled_kinds == {"denoise_cfg", "denoise_keep", "denoise_reuse", "denoise_cfg_keep", "denoise_cfg_reuse"}
    eager = tiny_engine.generate(requests)
    for a, b, c in zip(compiled, again, eager):
        assert a.ok and b.ok and a.cache == c.cache
        assert_within_compiled_noise(a.latents, c.latents)
        assert torch.equal(a.latents, b.latents)


def test_warmup_prepares_every_cached_kind_at_every_bucket():
    """After a warmup with one cached request, two cached requests batched together (bucket 2 of
    both the keep and the reuse kind) compile nothing on the frozen engine."""
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", buckets=BucketSpec(batch_sizes=(1, 2)),
                              compile_config=CompileConfig(backend="aot_eager"))  # fmt: skip
    [warm] = engine.warmup([_request(0, _cache(0.06))])
    assert warm.ok and _calls(warm)["reused"] > 0
    prepared = {(signature.step_kind, signature.batch) for signature in engine.compiler.signatures}
    assert prepared == {(kind, batch) for kind in ("denoise_cfg_keep", "denoise_cfg_reuse") for batch in (1, 2)}
    with engine.counters.expect(compiles=0):
        results = engine.generate([_request(1, _cache(0.06)), _request(2, _cache(0.06))])
    assert all(r.ok for r in results), [r.error for r in results]


def test_a_state_saved_between_a_keep_and_a_reuse_resumes_unchanged(tiny_engine, tmp_path):
    request = _request(9, _cache(0.04))
    [whole] = tiny_engine.generate([request])
    state = tiny_engine.start(request)
    while state.step_index < 3:  # steps 0, 1 computed, step 2 reused: a residual and accumulators are held
        tiny_engine.step(state)
    assert len(state.caching.kept) == 2 and state.caching.memo["skipped"] == 1
    state.save(tmp_path / "state.pt")
    resumed = tiny_engine.finish(tiny_engine.resume(T2VState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, whole.latents)
    assert resumed.cache == whole.cache


def test_loops_without_step_caching_reject_a_cached_request():
    engine = Engine.from_card("tiny-wan2.2-a14b", device="cpu")  # two experts: the residual of one is not the other's
    positive, negative = embeds(2, engine.card)
    request = Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=0, cache=_cache(0.06), **SHAPE)
    with pytest.raises(RequestRejected, match="cache: card 'tiny-wan2.2-a14b' runs loop 't2v_two_expert'; step caching"):
        engine.start(request)
