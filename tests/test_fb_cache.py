"""FBCache as an interceptor: settings validated, decisions and latents as diffusers' FirstBlockCache hooks
on the same weights, one host copy per group for the decision, compiled equal to eager, and requests
with FBCache, MagCache and none interleaved or resumed (also between a step's two launches) unchanged."""

import pytest
import torch
from diffusers import WanPipeline
from diffusers.hooks import FirstBlockCacheConfig
from pydantic import ValidationError

from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.caching.fb_cache import FirstBlockCache, FirstBlockCacheSettings
from fvgraph.caching.fb_cache_steps import AFTER_FIRST_KINDS, CHANGE
from fvgraph.models.components import diffusers_scheduler
from fvgraph.loops.t2v_loop import T2VState
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from fvgraph.runtime.host_outputs import copy_to_host
from cache_helpers import run_together_and_alone
from conftest import embeds
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

STEPS = 10
SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": STEPS}
# On tiny-wan (seed 21, guidance 5) diffusers' hooks compute the later blocks in 13 of 20 denoiser
# calls at 0.059, where at step 2 the cond branch reuses while the uncond branch computes, and in 6
# of 20 at 0.1.
MIXED, LOW = 0.059, 0.1
DECISIONS = {"c": True, "r": False}


def _request(seed: int, cache: dict | None, guidance_scale: float = 5.0) -> Request:
    positive, negative = embeds(seed, get_card("tiny-wan"))
    return Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale, seed=seed,
                   output_type="latent", cache=cache, **SHAPE)  # fmt: skip


def _fb(threshold: float) -> dict:
    return {"method": "fbcache", "threshold": threshold}


def _full_calls(transformer) -> tuple[list[bool], list]:
    """Per denoiser call, in order: whether its last block ran (diffusers: one forward per call)."""
    calls: list[bool] = []
    handles = [transformer.blocks[0].register_forward_pre_hook(lambda m, a: calls.append(False)),
               transformer.blocks[-1].attn1.register_forward_pre_hook(lambda m, a: calls.__setitem__(-1, True))]  # fmt: skip
    return calls, handles


def _block_runs(transformer) -> tuple[dict[str, int], list]:
    runs = {"first": 0, "last": 0}
    handles = [transformer.blocks[0].register_forward_pre_hook(lambda m, a: runs.__setitem__("first", runs["first"] + 1)),
               transformer.blocks[-1].register_forward_pre_hook(lambda m, a: runs.__setitem__("last", runs["last"] + 1))]  # fmt: skip
    return runs, handles


def test_settings_are_validated_naming_the_field():
    assert Request(prompt="x", cache={"method": "fbcache"}).cache == FirstBlockCacheSettings(threshold=0.05)
    with pytest.raises(ValidationError, match=r"cache.treshold: Extra inputs are not permitted"):
        Request(prompt="x", cache={"method": "fbcache", "treshold": 0.1})
    with pytest.raises(ValidationError, match=r"cache.threshold: Input should be greater than or equal to 0"):
        Request(prompt="x", cache=_fb(-0.1))
    with pytest.raises(ValidationError, match=r"cache.method='fbcach' is not a known method; known methods: magcache, teacache, taylorseer, fbcache"):
        Request(prompt="x", cache={"method": "fbcach"})


def test_decisions_per_branch_follow_the_relative_change():
    policy = FirstBlockCache(FirstBlockCacheSettings(threshold=0.1))
    change = torch.tensor([[0.2, 1.0], [0.05, 1.0]])  # cond changed by 0.2, uncond by 0.05
    assert policy.decide_branches({}, 3, change, has_kept=True) == ((True, False), {})
    assert policy.decide_branches({}, 0, change, has_kept=False) == ((True, True), {})  # nothing kept: compute
    exact = FirstBlockCache(FirstBlockCacheSettings(threshold=0.25))  # 0.25 is exact in float32
    assert exact.decide_branches({}, 3, torch.tensor([[0.5, 2.0]]), has_kept=True) == ((False,), {})  # not above


def test_the_group_reads_each_host_output_in_one_copy():
    results = [{CHANGE: torch.full((1, 2, 2), float(i)), "latents": torch.zeros(1, 3)} for i in range(3)]
    latents = [r["latents"] for r in results]
    copy_to_host(results, (CHANGE,))
    assert len({r[CHANGE].untyped_storage().data_ptr() for r in results}) == 1  # rows of one copied tensor
    assert [r[CHANGE].shape for r in results] == [(1, 2, 2)] * 3 and [r[CHANGE][0, 0, 0].item() for r in results] == [0, 1, 2]
    assert all(r["latents"] is t for r, t in zip(results, latents))  # other outputs untouched


def test_latents_and_full_calls_match_diffusers_first_block_cache(tiny_engine):
    request_counts = {}
    for threshold in (MIXED, LOW):
        c = load_components(tiny_engine.card, None, torch.device("cpu"))  # the same weights, nothing of fvgraph in them
        pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                           scheduler=diffusers_scheduler(tiny_engine.card.recipe.sampler))  # fmt: skip
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        request = _request(21, _fb(threshold))
        theirs, their_hooks = _full_calls(pipe.transformer)
        ours, our_hooks = _block_runs(tiny_engine.loop.components.transformer)
        decided: list[bool] = []  # ours, from the kind of each step's second launch: one letter per branch

        def record(state, plan, result):
            if plan.kind in AFTER_FIRST_KINDS.values():
                decided.extend(DECISIONS[letter] for letter in plan.kind.rsplit("_", 1)[1])

        try:
            reference = pipe(prompt_embeds=request.prompt_embeds[None], negative_prompt_embeds=request.negative_prompt_embeds[None],
                             guidance_scale=5.0, generator=torch.Generator().manual_seed(21), output_type="latent", **SHAPE).frames  # fmt: skip
            [result] = tiny_engine.generate([request], on_result=record)
        finally:
            for handle in their_hooks + our_hooks:
                handle.remove()
        assert result.ok, result.error
        assert decided == theirs and len(theirs) == 2 * STEPS  # the same denoiser calls ran their later blocks
        assert ours == {"first": 2 * STEPS, "last": sum(theirs)}  # the first block once per call, the rest when computed
        assert {k: result.cache[k] for k in ("method", "computed", "reused")} == {"method": "fbcache", "computed": sum(theirs), "reused": 2 * STEPS - sum(theirs)}
        assert 0 < result.cache["flops"] < result.cache["flops_uncached"]  # skipped blocks are FLOPs avoided
        assert_matches_reference(result.latents, reference)
        request_counts[threshold] = (sum(theirs), theirs)
    assert request_counts[MIXED][0] > request_counts[LOW][0] > 2  # the thresholds decide differently
    steps = request_counts[MIXED][1]
    assert any(cond != uncond for cond, uncond in zip(steps[::2], steps[1::2]))  # the branches decided apart


def test_a_threshold_of_zero_equals_no_cache_bit_for_bit(tiny_engine):
    """The two launches run diffusers' forward split at the first block: with every block computed
    the latents equal the plain step's."""
    cached, plain = tiny_engine.generate([_request(5, _fb(0.0)), _request(5, None)])
    assert {k: cached.cache[k] for k in ("method", "computed", "reused")} == {"method": "fbcache", "computed": 2 * STEPS, "reused": 0}
    assert torch.equal(cached.latents, plain.latents)
    # every block ran, plus the embeddings once more per step in the second launch
    assert cached.cache["flops"] >= cached.cache["flops_uncached"] > 0


def _mixed() -> list[Request]:
    magcache = {"method": "magcache", "threshold": 0.06, "max_skip_steps": 3, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}
    return [_request(21, _fb(MIXED)), _request(2, magcache), _request(3, None), _request(21, _fb(LOW), 1.0)]


def test_fbcache_magcache_and_uncached_requests_together_equal_each_alone(tiny_engine):
    requests = _mixed()
    together = run_together_and_alone(tiny_engine, requests)
    assert together[0].cache["reused"] > 0 and together[3].cache["reused"] > 0


def test_both_launches_of_a_step_run_in_one_tick(tiny_engine):
    """The first launch's kind `continues`: its request's second launch runs in the same tick, so a
    request with FBCache moves one step per tick, as an uncached one beside it."""
    requests = [_request(21, _fb(MIXED)), _request(3, None)]
    for request in requests:
        tiny_engine.submit(request)
    ticks, results = 0, {}
    while tiny_engine.has_work():
        results.update({r.request_id: r for r in tiny_engine.tick()})
        ticks += 1
    assert ticks == STEPS + 1  # a denoise step per tick, then the tick that finishes both
    alone = tiny_engine.generate(requests[:1])[0]
    assert torch.equal(results[requests[0].request_id].latents, alone.latents)


def test_compiled_first_block_steps_equal_eager_and_add_no_recompile(tiny_engine):
    # one batch bucket of 2: the groups of one request are padded, and four signatures cover the run
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="aot_eager"),
                              buckets=BucketSpec(batch_sizes=(2,)))  # fmt: skip
    requests = [_request(21, _fb(MIXED)), _request(3, _fb(LOW))]
    compiled = engine.generate(requests)
    with engine.counters.expect(compiles=0):  # every (kind, batch) signature of these requests is compiled now
        again = engine.generate(requests)
    signatures = {(signature.step_kind, signature.batch) for signature in engine.compiler.signatures}
    # both requests' first launches ran as one batch; their second launches split by decision
    assert signatures == {("denoise_cfg_first_block", 2), *{(f"denoise_cfg_after_first_{d}", 2) for d in ("cc", "rc", "rr")}}
    eager = tiny_engine.generate(requests)
    for a, b, c in zip(compiled, again, eager):
        assert a.ok and b.ok and a.cache == c.cache, (a.error, a.cache, c.cache)
        assert_within_compiled_noise(a.latents, c.latents)
        assert torch.equal(a.latents, b.latents)


def test_warmup_prepares_every_branch_pattern_the_warmup_run_did_not_meet():
    """A warmup whose request computes every branch (threshold 0: pattern cc only) also prepares the
    cr, rc and rr second launches, so requests that reuse then run on the frozen engine."""
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="aot_eager"),
                              buckets=BucketSpec(batch_sizes=(2,)))  # fmt: skip
    [warm] = engine.warmup([_request(21, _fb(0.0))])
    assert warm.ok and warm.cache["reused"] == 0
    prepared = {signature.step_kind for signature in engine.compiler.signatures}
    assert prepared == {"denoise_cfg_first_block", *(AFTER_FIRST_KINDS[(True, c)] for c in
                                                     ((True, True), (True, False), (False, True), (False, False)))}  # fmt: skip
    with engine.counters.expect(compiles=0):
        results = engine.generate([_request(21, _fb(MIXED)), _request(3, _fb(LOW))])
    assert all(r.ok for r in results) and all(r.cache["reused"] > 0 for r in results), [r.error for r in results]


def test_the_launches_without_guidance_trace_whole_and_equal_eager(tiny_engine):
    """fullgraph capture (a graph break would fail) of the single-branch kinds, with dynamo's eager backend."""
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="eager"),
                              buckets=BucketSpec(batch_sizes=(1,)))  # fmt: skip
    request = _request(21, _fb(LOW), guidance_scale=1.0)
    [compiled], [eager] = engine.generate([request]), tiny_engine.generate([request])
    kinds = {signature.step_kind for signature in engine.compiler.signatures}
    assert kinds == {"denoise_first_block", "denoise_after_first_c", "denoise_after_first_r"}
    assert compiled.ok and compiled.cache == eager.cache and 0 < eager.cache["reused"] < STEPS
    assert_within_compiled_noise(compiled.latents, eager.latents)


@pytest.mark.parametrize("between_launches", [True, False], ids=["between-launches", "between-steps"])
def test_a_saved_state_resumes_unchanged(tiny_engine, tmp_path, between_launches):
    request = _request(21, _fb(MIXED))
    [whole] = tiny_engine.generate([request])
    state = tiny_engine.start(request)
    while state.step_index < 2 or (state.caching.head == []) == between_launches:  # step 2: cond reuses, uncond computes
        tiny_engine.step(state)
    assert len(state.caching.kept) == len(state.caching.first) == 2
    if between_launches:
        assert state.step_index == 2 and len(state.caching.head) == 2 and len(state.caching.compute) == 2
    state.save(tmp_path / "state.pt")
    resumed = tiny_engine.finish(tiny_engine.resume(T2VState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, whole.latents)
    assert resumed.cache == whole.cache


def test_a_resumed_state_between_launches_is_checked(tiny_engine, tmp_path):
    state = tiny_engine.start(_request(21, _fb(MIXED)))
    tiny_engine.step(state)  # step 0's first launch
    state.caching.compute = [True]
    state.save(tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"caching.compute: must hold one decision per tensor of caching.head \(2\), got 1"):
        tiny_engine.resume(T2VState.load(tmp_path / "state.pt"))


@pytest.mark.gpu
def test_graphed_first_block_steps_on_cuda_equal_eager_and_read_the_change_on_the_host(tiny_card):
    """-O2: both launches replay CUDA graphs; the first launch's change comes back as a host tensor."""
    requests = [_request(21, _fb(MIXED)), _request(3, _fb(LOW))]
    eager = Engine.from_card("tiny-wan", device="cuda").generate(requests)
    engine = Engine.from_card("tiny-wan", device="cuda", opt_level=2, compile_config=CompileConfig(backend="inductor"))
    engine.generate(requests)
    devices = set()

    def record(state, plan, result):
        if CHANGE in result:
            devices.add(result[CHANGE].device.type)

    with engine.counters.expect(compiles=0, captures=0):
        graphed = engine.generate(requests, on_result=record)
    assert devices == {"cpu"} and engine.counters.replays > 0
    tol = tiny_card.parity.tolerance("fp32", "loop")  # on CUDA: the GPU's noise is not the CPU's measured one
    for a, b in zip(eager, graphed):
        assert b.ok and a.cache == b.cache, (b.error, a.cache, b.cache)
        torch.testing.assert_close(b.latents, a.latents, atol=tol.atol, rtol=tol.rtol)
