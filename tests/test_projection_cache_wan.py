"""The Wan projection-cache layout (fvgraph/models/wan_projections.py) on tiny-wan: bit-identical
generations, exact hit counts, each conditioning prepared once per denoiser call before its
projections, untouched state_dict, clean removal, and a fullgraph trace of the denoise step with no breaks.

This module builds its own engine; the session's `tiny_engine` is never modified.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from diffusers import WanTransformer3DModel

from fvgraph.cards import get_card
from fvgraph.engine.engine import Engine
from fvgraph.runtime.projection_cache import ExactProjectionCache
from fvgraph.models.projection_cache_protocol import ProjectionCache
from fvgraph.models.wan_projections import (
    TEXT_EMBEDDER,
    apply_projection_cache,
    remove_projection_cache,
    request_constant_projections,
)
from fvgraph.request import Request
from fvgraph.loops.t2v_loop import DENOISE_CFG
from conftest import embeds


@pytest.fixture(scope="module")
def wan():
    """This module's own tiny-wan engine, without the engine's default cache: the tests apply,
    compare and remove caches on it themselves."""
    return Engine.from_card("tiny-wan", device="cpu", projection_cache_bytes=0)  # the tests apply their own


@contextlib.contextmanager
def cached(engine, cache: ExactProjectionCache):
    """`cache` applied to `engine`'s transformer for the duration of the block."""
    apply_projection_cache(engine.loop.components.transformer, cache)
    try:
        yield cache
    finally:
        remove_projection_cache(engine.loop.components.transformer)


def _new_cache() -> ExactProjectionCache:
    return ExactProjectionCache(max_bytes=64 * 1024**2)


def _num_projections(engine) -> int:
    return 1 + 2 * engine.loop.components.transformer.config.num_layers  # text_embedder + K/V per block


def _requests(card) -> list[Request]:
    pos, neg = embeds(11, card)
    return [
        Request(prompt="a lighthouse at dusk", seed=1, num_inference_steps=4, output_type="latent"),
        Request(prompt="waves", negative_prompt="fog", seed=2, guidance_scale=7.5, num_inference_steps=3),
        Request(prompt_embeds=pos, negative_prompt_embeds=neg, seed=3, num_inference_steps=3, height=48, width=80),
        Request(prompt="no guidance", seed=4, guidance_scale=1.0, num_inference_steps=3, output_type="latent"),
        Request(prompt="a lighthouse at dusk", seed=5, num_inference_steps=2, output_type="latent"),
    ]


def _first_denoise_inputs(engine, seed: int) -> dict[str, torch.Tensor]:
    pos, neg = embeds(seed, engine.card)
    request = Request(prompt_embeds=pos, negative_prompt_embeds=neg, seed=seed, num_inference_steps=3)
    return engine.loop.next(engine.start(request)).inputs


def _assert_same_results(expected, actual) -> None:
    for ref, got in zip(expected, actual, strict=True):
        assert ref.ok and got.ok, (ref.error, got.error)
        assert torch.equal(ref.latents, got.latents), ref.request_id
        if ref.frames is not None:
            assert (ref.frames == got.frames).all()


# -- (a) exactness ---------------------------------------------------------------------------


def test_interleaved_generation_is_bit_identical_with_the_cache(wan):
    reference = wan.generate(_requests(wan.card))
    with cached(wan, _new_cache()) as cache:
        _assert_same_results(reference, wan.generate(_requests(wan.card)))
        first = cache.stats
        # A second round reuses every projection across requests (equal prompts hash to equal keys).
        _assert_same_results(reference, wan.generate(_requests(wan.card)))
        second = cache.stats
    assert first.hits > 0 and first.bypasses == {}
    assert second.misses == first.misses and second.hits > first.hits


# -- (b) it really hits ----------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [True, False])
def test_each_projection_misses_once_per_branch_then_hits_every_step(wan, cfg):
    steps, branches = 5, 2 if cfg else 1
    pos, neg = embeds(21, wan.card)
    request = Request(
        prompt_embeds=pos,
        negative_prompt_embeds=neg if cfg else None,
        guidance_scale=5.0 if cfg else 1.0,
        seed=0,
        num_inference_steps=steps,
        output_type="latent",
    )
    with cached(wan, _new_cache()) as cache:
        assert wan.generate([request])[0].ok
    pairs = branches * _num_projections(wan)  # distinct (projection, conditioning) pairs
    stats = cache.stats
    assert (stats.misses, stats.hits, stats.bypasses, stats.entries) == (pairs, (steps - 1) * pairs, {}, pairs)
    # Hashing is once per conditioning tensor, not per step or per block: the prompt embeddings and
    # the text_embedder output of each branch, both in prepare(); no projection hashed anything itself.
    assert (stats.hashes, stats.unprepared_hashes) == (2 * branches, 0)


# -- (b2) prepare is wired -------------------------------------------------------------------


class _Recorder:
    """The cache's prepare/project calls in order, each with its conditioning tensor and the hash count
    after it; `calls` collects them per denoiser call."""

    def __init__(self, cache: ExactProjectionCache) -> None:
        self.cache, self.calls = cache, []
        real_prepare, real_project = cache.prepare, cache.project

        def prepare(conditioning):
            real_prepare(conditioning)
            self.calls[-1].append(("prepare", None, conditioning, cache.stats.hashes))

        def project(name, projection, conditioning, compute, variant=None):
            out = real_project(name, projection, conditioning, compute, variant)
            self.calls[-1].append(("project", name, conditioning, cache.stats.hashes))
            return out

        cache.prepare, cache.project = prepare, project  # the instance attributes the forwards call

    def denoiser_call(self, module, args) -> None:  # a forward pre-hook on condition_embedder
        self.calls.append([])


def test_each_conditioning_is_prepared_once_per_denoiser_call_before_its_projections(wan):
    transformer, step, steps = wan.loop.components.transformer, wan.executor.steps[DENOISE_CFG], 3
    cache = _new_cache()
    assert isinstance(cache, ProjectionCache)
    recorder = _Recorder(cache)
    # The embedder runs once per denoiser call, in the whole forward and in Wan's sections alike; it is
    # no projection, so its hook does not make the cache step aside.
    handle = transformer.condition_embedder.register_forward_pre_hook(recorder.denoiser_call)
    inputs = _first_denoise_inputs(wan, 51)
    try:
        with cached(wan, cache), torch.no_grad():
            for _ in range(steps):
                step(**inputs)
    finally:
        handle.remove()
    assert len(recorder.calls) == steps * 2  # one denoiser call per CFG branch and step
    for call in recorder.calls:
        prepared = [c for kind, _, c, _ in call if kind == "prepare"]
        projected = [(name, c) for kind, name, c, _ in call if kind == "project"]
        assert len(prepared) == 2 and prepared[0] is not prepared[1]  # prompt embeddings, then ctx: once each
        assert len(projected) == _num_projections(wan) and projected[0][0] == TEXT_EMBEDDER
        assert projected[0][1] is prepared[0] and all(c is prepared[1] for _, c in projected[1:])
        order = [kind for kind, *_ in call]
        assert order == ["prepare", "project", "prepare", *["project"] * (_num_projections(wan) - 1)]
        hashes = [after for *_, after in call]  # no project() hashed: the keys came from prepare()
        assert all(hashes[i] == hashes[i - 1] for i, kind in enumerate(order) if kind == "project")
    stats = cache.stats
    assert (stats.hashes, stats.unprepared_hashes) == (2 * 2, 0)  # once per conditioning of each branch
    assert (stats.misses, stats.hits) == (2 * _num_projections(wan), (steps - 1) * 2 * _num_projections(wan))


# -- (c) the model is untouched ----------------------------------------------------------------


def test_state_dict_is_unchanged_and_remove_restores_the_forwards(wan):
    transformer, step = wan.loop.components.transformer, wan.executor.steps[DENOISE_CFG]
    before = transformer.state_dict()
    cache = _new_cache()
    apply_projection_cache(transformer, cache)
    try:
        after = transformer.state_dict()
        assert list(after) == list(before)
        for key, tensor in before.items():
            assert after[key].data_ptr() == tensor.data_ptr() and torch.equal(after[key], tensor), key
        assert all("forward" in module.__dict__ for _, module in request_constant_projections(transformer))
        with pytest.raises(ValueError, match="already route through a projection cache"):
            apply_projection_cache(transformer, _new_cache())
        with torch.no_grad():
            step(**_first_denoise_inputs(wan, 31))
        assert cache.stats.misses == 2 * _num_projections(wan)
    finally:
        remove_projection_cache(transformer)
    assert not any("forward" in module.__dict__ for module in transformer.modules())  # class forwards back
    with torch.no_grad():
        step(**_first_denoise_inputs(wan, 31))
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.bypasses) == (0, 2 * _num_projections(wan), {})  # not consulted


def test_instance_forward_installed_earlier_is_kept_and_restored(wan):
    """A forward another tool installed is what the cache computes with, and what remove puts back."""
    text_embedder = wan.loop.components.transformer.condition_embedder.text_embedder
    calls = []

    def earlier(x):
        calls.append(x)
        return type(text_embedder).forward(text_embedder, x)

    text_embedder.forward = earlier
    try:
        cache = ExactProjectionCache(max_bytes=1 << 20)
        apply_projection_cache(wan.loop.components.transformer, cache)
        with torch.no_grad():
            for _ in range(2):
                wan.executor.steps[DENOISE_CFG](**_first_denoise_inputs(wan, 32))
        assert len(calls) == 2  # two branches computed once; the second step hit
        remove_projection_cache(wan.loop.components.transformer)
        assert text_embedder.__dict__["forward"] is earlier
    finally:
        text_embedder.__dict__.pop("forward", None)
        remove_projection_cache(wan.loop.components.transformer)


def test_in_place_weight_update_recomputes(wan):
    """Keys see weight versions: an update between requests must not return stale K/V."""
    request = lambda: Request(prompt="a fox", seed=7, num_inference_steps=2, output_type="latent")  # noqa: E731
    cache = _new_cache()
    with cached(wan, cache):
        wan.generate([request()])  # warm the cache with the current weights
    weight = wan.loop.components.transformer.blocks[1].attn2.to_v.weight
    saved = weight.clone()
    try:
        weight.mul_(1.5)
        reference = wan.generate([request()])
        with cached(wan, cache):
            _assert_same_results(reference, wan.generate([request()]))
        assert cache.stats.invalidations == 2  # the to_v entry of each CFG branch
    finally:
        weight.copy_(saved)


# -- (d) compile -------------------------------------------------------------------------------


def test_compiled_denoise_step_traces_whole_and_matches_eager(wan):
    step = wan.executor.steps[DENOISE_CFG]
    a, b = _first_denoise_inputs(wan, 41), _first_denoise_inputs(wan, 42)
    graphs = []

    def capturing_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        expected = [step(**x) for x in (a, b)]
        with cached(wan, _new_cache()) as cache:
            step(**a)  # the cache holds entries for `a` before tracing; none may leak into the graph
            compiled = torch.compile(step, fullgraph=True, backend=capturing_backend)
            outputs = [compiled(**x) for x in (a, b)]
    assert len(graphs) == 1  # one whole graph, reused for a new prompt without recompiling
    for ref, out in zip(expected, outputs):
        assert ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref)
    stats = cache.stats
    assert stats.bypasses == {"compiling": 2 * _num_projections(wan)}  # each call site, once per trace
    assert (stats.hits, stats.misses) == (0, 2 * _num_projections(wan))  # only the eager warm-up


def test_applied_transformer_is_freed_without_a_gc_pass():
    """The installed forwards hold their module weakly: no cycle keeps a dropped model's memory alive."""
    transformer = WanTransformer3DModel(**get_card("tiny-wan").components["transformer"].config)
    cache = _new_cache()
    apply_projection_cache(transformer, cache)
    alive = weakref.ref(transformer)
    gc.disable()
    try:
        del transformer
        assert alive() is None
    finally:
        gc.enable()


# -- unsupported models ----------------------------------------------------------------------


def test_unsupported_models_are_rejected_with_the_reason():
    config = dict(get_card("tiny-wan").components["transformer"].config)
    i2v = WanTransformer3DModel(**{**config, "image_dim": 16, "added_kv_proj_dim": 24})
    with pytest.raises(ValueError, match="I2V config"):
        apply_projection_cache(i2v, ExactProjectionCache(max_bytes=1 << 20))
    fused = WanTransformer3DModel(**config)
    fused.fuse_qkv_projections()
    with pytest.raises(ValueError, match="unfuse_qkv_projections"):
        apply_projection_cache(fused, ExactProjectionCache(max_bytes=1 << 20))
    with pytest.raises(TypeError, match="WanTransformer3DModel only"):
        apply_projection_cache(torch.nn.Linear(2, 2), ExactProjectionCache(max_bytes=1 << 20))
    assert not any("forward" in m.__dict__ for m in (*i2v.modules(), *fused.modules()))


def test_eager_engine_uses_the_cache_by_default_and_compiled_does_not():
    from fvgraph.compile.compiler import CompileConfig

    eager = Engine.from_card("tiny-wan", device="cpu")
    eager.generate([Request(prompt="on by default", seed=0, num_inference_steps=3, num_frames=5)])
    stats = eager.projection_cache.stats
    assert stats.misses == 2 * (1 + 2 * 2) and stats.hits == 2 * stats.misses
    assert Engine.from_card("tiny-wan", device="cpu", projection_cache_bytes=0).projection_cache is None
    compiled = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="eager"))
    assert compiled.projection_cache is None
