"""Eager fvgraph equals diffusers' own WanPipeline given the same weights, embeddings, seed and scheduler."""

import pytest
import torch
from diffusers import WanPipeline

from fvgraph.request import Request
from fvgraph.samplers import diffusers_scheduler
from conftest import embeds

SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 6}


@pytest.fixture(scope="module")
def pipeline(tiny_engine):
    c = tiny_engine.loop.components
    return WanPipeline(
        tokenizer=c.tokenizer,
        text_encoder=c.text_encoder,
        vae=c.vae,
        transformer=c.transformer,
        scheduler=diffusers_scheduler(tiny_engine.card.recipe.sampler),
    )


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])
def test_final_latents_match_wan_pipeline(tiny_engine, pipeline, guidance_scale):
    positive, negative = embeds(11, tiny_engine.card)
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
    [result] = tiny_engine.generate([request])
    assert result.ok, result.error
    tol = tiny_engine.card.parity.tolerance("fp32", "loop")
    torch.testing.assert_close(result.latents, reference, atol=tol.atol, rtol=tol.rtol)


def test_decoded_frames_match_wan_pipeline(tiny_engine, pipeline):
    positive, negative = embeds(12, tiny_engine.card)
    video = pipeline(
        prompt_embeds=positive, negative_prompt_embeds=negative, generator=torch.Generator().manual_seed(3),
        output_type="np", **SHAPE,
    ).frames[0]  # fmt: skip
    [result] = tiny_engine.generate(
        [Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=3, **SHAPE)]
    )
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
