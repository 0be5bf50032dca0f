"""Eager fvgraph equals diffusers' own WanPipeline given the same weights, embeddings, seed and scheduler.

The pipeline runs its own module instances, built apart from the engine's from the same seeded card
(equal weights, checked by content hash): the engine's transformer has the projection cache bound
into its forwards, the pipeline's has nothing of fvgraph in it, so a projection-cache error shows
here. A second engine with the projection cache off is held to the same reference.
"""

import pytest
import torch
from diffusers import WanPipeline

from fvgraph.cards import get_card
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from fvgraph.models.wan_projections import request_constant_projections
from fvgraph.request import Request
from fvgraph.models.components import diffusers_scheduler
from fvgraph.loops import steps
from conftest import embeds
from reference_helpers import assert_matches_reference

SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 6}


def _rebound(transformer) -> list[str]:
    """Names of the request-constant projections whose forward is an instance attribute (rebound)."""
    return [name for name, module in request_constant_projections(transformer) if "forward" in module.__dict__]


@pytest.fixture(scope="module")
def pipeline(tiny_engine):
    c = load_components(get_card("tiny-wan"), None, torch.device("cpu"))  # untouched copy of the same weights
    assert c.weights_version == tiny_engine.loop.components.weights_version
    return WanPipeline(
        tokenizer=c.tokenizer,
        text_encoder=c.text_encoder,
        vae=c.vae,
        transformer=c.transformer,
        scheduler=diffusers_scheduler(tiny_engine.card.recipe.sampler),
    )


@pytest.fixture(scope="module")
def uncached_engine():
    return Engine.from_card("tiny-wan", device="cpu", projection_cache_bytes=0)


def test_the_two_sides_share_no_module_and_only_the_engine_has_the_cache(tiny_engine, uncached_engine, pipeline):
    ours = tiny_engine.loop.components.transformer
    assert pipeline.transformer is not ours and pipeline.text_encoder is not tiny_engine.loop.components.text_encoder
    assert not any(p.data_ptr() == q.data_ptr() for p, q in zip(pipeline.transformer.parameters(), ours.parameters()))
    assert _rebound(ours) and len(_rebound(ours)) == len(list(request_constant_projections(ours)))
    assert _rebound(pipeline.transformer) == [] and _rebound(uncached_engine.loop.components.transformer) == []


def _generate(engine, request):
    [result] = engine.generate([request])
    assert result.ok, result.error
    return result


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])
@pytest.mark.parametrize("projection_cache", [True, False], ids=["projection-cache", "no-projection-cache"])
def test_final_latents_match_wan_pipeline(tiny_engine, uncached_engine, pipeline, guidance_scale, projection_cache):
    engine = tiny_engine if projection_cache else uncached_engine
    positive, negative = embeds(11, engine.card)
    reference = pipeline(
        prompt_embeds=positive,
        negative_prompt_embeds=negative,
        guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(7),
        output_type="latent",
        **SHAPE,
    ).frames
    request = Request(
        prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale, seed=7,
        output_type="latent", **SHAPE,
    )  # fmt: skip
    hits_before = engine.projection_cache.stats.hits if projection_cache else 0
    result = _generate(engine, request)
    assert_matches_reference(result.latents, reference)
    if projection_cache:  # the cache served the run: a wrong cached K/V would have moved the latents
        assert engine.projection_cache.stats.hits > hits_before


def test_decoded_frames_match_wan_pipeline(tiny_engine, pipeline):
    positive, negative = embeds(12, tiny_engine.card)
    video = pipeline(
        prompt_embeds=positive, negative_prompt_embeds=negative, generator=torch.Generator().manual_seed(3),
        output_type="np", **SHAPE,
    ).frames[0]  # fmt: skip
    result = _generate(tiny_engine, Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=3, **SHAPE))
    assert result.frames.shape == (9, 64, 64, 3)
    expected = torch.from_numpy(video * 255).round().clamp(0, 255)
    # a uint8 step of 1 covers the fp32 noise of the denoise loop
    assert (torch.from_numpy(result.frames).float() - expected).abs().max() <= 1


def test_text_path_matches_wan_encode_prompt(tiny_engine, pipeline):
    reference_pos, reference_neg = pipeline.encode_prompt(
        "a red fox in fresh snow", negative_prompt="blurry", max_sequence_length=tiny_engine.card.shapes.text_len
    )
    state = tiny_engine.start(Request(prompt="a red fox in fresh snow", negative_prompt="blurry", seed=0))
    tiny_engine.step(state)  # the text_encode step
    assert torch.equal(state.prompt_embeds, reference_pos)
    assert torch.equal(state.negative_prompt_embeds, reference_neg)


@pytest.mark.parametrize("error", [1e-3, 5e-5])
def test_a_sampler_update_off_by_a_small_fraction_fails_the_reference_tolerance(uncached_engine, pipeline, monkeypatch, error):
    """REFERENCE_TOLERANCE sees a 0.1% (and a 0.005%) systematic error in the sampler update, with the
    exact update passing it on the same request. The 0.005% error passes the card's loop tolerance,
    which is why the reference tests do not use that one."""
    exact = steps.sampler_update  # what DenoiseStep's forward calls

    def off_by_a_fraction(sampler, latents, noise, carry, coeffs, fresh_noise=None):
        updated = exact(sampler, latents, noise, carry, coeffs, fresh_noise)
        return {**updated, "latents": latents + (1 + error) * (updated["latents"] - latents)}

    positive, negative = embeds(11, uncached_engine.card)
    reference = pipeline(prompt_embeds=positive, negative_prompt_embeds=negative, generator=torch.Generator().manual_seed(7),
                         output_type="latent", **SHAPE).frames  # fmt: skip
    request = Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=7, output_type="latent", **SHAPE)
    assert_matches_reference(_generate(uncached_engine, request).latents, reference)
    monkeypatch.setattr(steps, "sampler_update", off_by_a_fraction)
    perturbed = _generate(uncached_engine, request).latents
    with pytest.raises(AssertionError, match="not close"):
        assert_matches_reference(perturbed, reference)
    if error == 5e-5:
        loose = uncached_engine.card.parity.tolerance("fp32", "loop")
        torch.testing.assert_close(perturbed, reference, atol=loose.atol, rtol=loose.rtol)
