"""Step caching on FLUX.1 Kontext: FBCache, TaylorSeer and MagCache on tiny-flux-kontext equal diffusers'
`enable_cache(...)` hooks on FluxKontextPipeline with the same weights (latents, and which denoiser
calls ran their blocks). The blocks' image stream holds the edited image's tokens after the latents'
(as the hooks see the pipeline's calls); the prediction reads the latents' tokens alone. A cache that
never reuses equals the plain edit bit for bit; TeaCache, without coefficients for Kontext, is refused."""

from __future__ import annotations

import inspect

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import FluxKontextPipeline
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request
from cache_helpers import flux_block_calls, run_recording_blocks
from reference_helpers import assert_matches_reference

STEPS = 8
EDIT = dict(prompt="make it winter", guidance_scale=2.5, num_inference_steps=STEPS, height=48, width=64, max_sequence_length=32)
TRUE_CFG = {**EDIT, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
IMAGE = PIL.Image.fromarray(np.random.default_rng(4).integers(0, 256, (80, 128, 3), dtype=np.uint8))
FB_THRESHOLDS = (0.2, 0.3)
TAYLOR = {"cache_interval": 3, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32"}
MAG = {"max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card("tiny-flux-kontext", device="cpu")


def _pipeline(card):
    """FluxKontextPipeline on a fresh copy of the card's seeded weights: nothing of fvgraph in them."""
    c = load_components(card, None, torch.device("cpu"))
    accepted = inspect.signature(FluxKontextPipeline.__init__).parameters
    pipe = FluxKontextPipeline(**{k: m for k, m in c.modules().items() if k in accepted}, scheduler=diffusers_scheduler(card.recipe.sampler))
    pipe.set_progress_bar_config(disable=True)
    return pipe


class _InCacheContexts:
    """The transformer as FluxKontextPipeline calls it, each call inside the cache context FluxPipeline
    sets for that branch ("cond", then "uncond" under true CFG). FluxKontextPipeline (diffusers 0.42.1)
    sets none, and diffusers' cache hooks refuse a call outside one: this adds FluxPipeline's contexts
    and nothing else."""

    def __init__(self, transformer, branches: int):
        self._transformer, self._branches, self._calls = transformer, branches, 0

    def __getattr__(self, name):
        return getattr(self._transformer, name)

    def __call__(self, *args, **kwargs):
        branch = ("cond", "uncond")[self._calls % self._branches]
        self._calls += 1
        with self._transformer.cache_context(branch):
            return self._transformer(*args, **kwargs)


def _reference(engine, config, args: dict) -> tuple[torch.Tensor, list[bool]]:
    pipe = _pipeline(engine.card)
    transformer = pipe.transformer
    transformer.enable_cache(config)
    calls, handles = flux_block_calls(transformer)
    pipe.transformer = _InCacheContexts(transformer, 2 if "true_cfg_scale" in args else 1)
    try:
        # max_area = the output's own: the pipeline rescales its output to max_area, fvgraph keeps the request's size
        packed = pipe(image=IMAGE, generator=torch.Generator().manual_seed(5), output_type="latent",
                      max_area=args["height"] * args["width"], **args).images  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    return FluxKontextPipeline._unpack_latents(packed, args["height"], args["width"], pipe.vae_scale_factor).unsqueeze(2), calls


def _ours(engine, cache: dict, args: dict):
    """The result, and per denoiser call whether its blocks ran (tests/cache_helpers.py)."""
    request = Request(image=IMAGE, seed=5, output_type="latent", cache=cache, **args)
    return run_recording_blocks(engine, request, fbcache=cache["method"] == "fbcache")


@pytest.mark.parametrize("args", [EDIT, TRUE_CFG], ids=["guidance", "true_cfg"])
def test_fbcache_on_an_edit_matches_diffusers_first_block_cache_at_two_thresholds(engine, args):
    counts = []
    for threshold in FB_THRESHOLDS:
        reference, theirs = _reference(engine, FirstBlockCacheConfig(threshold=threshold), args)
        result, ours = _ours(engine, {"method": "fbcache", "threshold": threshold}, args)
        assert len(theirs) == STEPS * (2 if "true_cfg_scale" in args else 1)
        assert ours == theirs  # the same denoiser calls ran their later blocks
        assert_matches_reference(result.latents, reference)
        counts.append(sum(theirs))
    assert counts[0] > counts[1] and counts[1] < len(theirs)  # the thresholds decide differently, and reuse


def test_taylorseer_on_an_edit_matches_diffusers_taylorseer(engine):
    config = TaylorSeerCacheConfig(use_lite_mode=True, **{**TAYLOR, "taylor_factors_dtype": torch.float32})
    reference, theirs = _reference(engine, config, TRUE_CFG)
    result, ours = _ours(engine, {"method": "taylorseer", **TAYLOR}, TRUE_CFG)
    assert len(theirs) == 2 * STEPS and 0 < sum(theirs) < 2 * STEPS
    assert ours == [True] * sum(theirs)  # a forecast step runs no transformer at all
    assert_matches_reference(result.latents, reference)


def test_magcache_on_an_edit_matches_diffusers_magcache(engine):
    threshold = 0.06
    reference, theirs = _reference(engine, MagCacheConfig(threshold=threshold, num_inference_steps=STEPS, **MAG), EDIT)
    result, ours = _ours(engine, {"method": "magcache", "threshold": threshold, **MAG}, EDIT)
    assert not all(theirs) and any(theirs)
    assert ours == theirs
    assert_matches_reference(result.latents, reference)


def test_an_edit_cache_that_never_reuses_equals_the_plain_edit_bit_for_bit_and_teacache_is_refused(engine):
    never = {"method": "magcache", "threshold": 0.06, **MAG, "max_skip_steps": 0}
    cached, plain = engine.generate([Request(image=IMAGE, seed=3, output_type="latent", cache=c, **TRUE_CFG) for c in (never, None)])
    assert cached.ok and plain.ok and cached.cache["reused"] == 0
    assert torch.equal(cached.latents, plain.latents)
    [tea] = engine.generate([Request(image=IMAGE, cache={"method": "teacache", "threshold": 0.1}, **EDIT)])
    assert tea.status == "rejected" and tea.error.startswith("cache"), tea.error
