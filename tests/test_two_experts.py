"""Wan 2.2 A14B two experts: the released card on a diffusers-written checkpoint matches WanPipeline
with transformer_2; each expert is its own signature; interleaving and resume hold across the boundary."""

import pytest
import torch
from diffusers import WanPipeline

from fvgraph.cards import get_card
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from fvgraph.loops.expert_loop import TwoExpertT2VState
from fvgraph.parity import Setting, compare
from fvgraph.request import Request
from fvgraph.models.components import diffusers_scheduler
from conftest import embeds
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

SHAPE = {"height": 48, "width": 64, "num_frames": 5}


@pytest.fixture(scope="module")
def a14b():
    return Engine.from_card("tiny-wan2.2-a14b", device="cpu")


@pytest.fixture(scope="module")
def a14b_checkpoint(tmp_path_factory):
    card = get_card("tiny-wan2.2-a14b")
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(WanPipeline, c, tmp_path_factory.mktemp("tiny-a14b-checkpoint"),
                          scheduler=diffusers_scheduler(card.recipe.sampler), boundary_ratio=card.recipe.boundary_ratio)  # fmt: skip


def test_released_card_on_a_diffusers_checkpoint_matches_wan_pipeline_with_two_experts(a14b_checkpoint):
    engine = Engine.from_card("wan2.2-t2v-a14b", checkpoint=a14b_checkpoint, device="cpu", dtype="fp32")  # a bf16 release
    assert engine.facts.experts == ("transformer", "transformer_2")
    recipe = engine.card.recipe
    pipe = reference_pipeline(WanPipeline, a14b_checkpoint, scheduler=diffusers_scheduler(recipe.sampler),
                              boundary_ratio=recipe.boundary_ratio)  # fmt: skip
    assert_shares_no_storage(engine, pipe)
    g = torch.Generator().manual_seed(31)  # full-length embeddings: diffusers does not pad short ones
    positive, negative = (torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(2))
    reference = pipe(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=4.0, guidance_scale_2=2.0,
                     generator=torch.Generator().manual_seed(3), output_type="latent", num_inference_steps=6, **SHAPE).frames  # fmt: skip
    kinds = []
    [result] = engine.generate(
        [Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=4.0, guidance_scale_2=2.0, seed=3,
                 output_type="latent", num_inference_steps=6, **SHAPE)],
        on_step=lambda state, kind: kinds.append(kind),
    )  # fmt: skip
    assert result.ok, result.error
    assert "denoise_cfg" in kinds and "denoise_cfg_2" in kinds  # the run straddles the boundary
    assert_matches_reference(result.latents, reference)


def _requests(card):
    pos, neg = embeds(17, card)
    return [
        Request(prompt="a mountain", seed=1, num_inference_steps=4, **SHAPE),
        Request(prompt_embeds=pos, negative_prompt_embeds=neg, seed=2, guidance_scale=5.0, guidance_scale_2=1.5,
                num_inference_steps=6, **SHAPE),  # fmt: skip
        Request(prompt="late start", seed=3, num_inference_steps=3, output_type="latent", **SHAPE),
    ]


def test_interleaved_equals_serial_with_requests_in_different_stages(a14b):
    card = a14b.card
    serial = [a14b.generate([r])[0] for r in _requests(card)]
    stages_per_tick: list[set] = []
    together = a14b.generate(_requests(card), on_step=lambda state, kind: stages_per_tick.append(kind))
    for alone, both in zip(serial, together):
        assert alone.ok and both.ok
        assert torch.equal(alone.latents, both.latents)
    assert {"denoise_cfg", "denoise_cfg_2"} <= set(stages_per_tick)


def test_a_request_saved_before_the_boundary_resumes_after_it(tmp_path, a14b):
    request = _requests(a14b.card)[1]
    [uninterrupted] = a14b.generate([request])
    state = a14b.start(request)
    a14b.step(state)  # the first high-noise step
    assert state.derived.kind == "denoise_cfg"
    state.save(tmp_path / "a14b.pt")
    resumed = a14b.finish(a14b.resume(TwoExpertT2VState.load(tmp_path / "a14b.pt")))
    assert torch.equal(resumed.latents, uninterrupted.latents)


def test_each_expert_compiles_its_own_signature_and_matches_eager():
    """-O1 (aot_eager) against -O0 tap by tap, over two steps: one per expert."""
    card = get_card("tiny-wan2.2-a14b")
    request = _requests(card)[1].model_copy(update={"num_inference_steps": 2})
    compiled = []
    report = compare(card, [request], Setting(0), Setting(1, backend="aot_eager"), prepare_b=compiled.append)
    assert report.passed, report.first_divergence
    assert {(s.step_kind, s.component) for s in compiled[0].compiler.signatures} == {
        ("denoise_cfg", "transformer"), ("denoise_cfg_2", "transformer_2")}  # fmt: skip


def test_guidance_scale_2_is_for_two_expert_cards_only(tiny_engine):
    [result] = tiny_engine.generate([Request(prompt="x", guidance_scale_2=2.0, seed=0, num_inference_steps=1, num_frames=1)])
    assert result.status == "rejected" and "guidance_scale_2: card 'tiny-wan' runs loop 't2v', which takes no guidance_scale_2" in result.error


def test_two_expert_image_to_video_matches_diffusers_without_an_image_encoder(tmp_path):
    """Wan 2.2 I2V A14B's shape: no CLIP tower, the first frame through the VAE only, two experts."""
    import numpy as np
    import PIL.Image
    from diffusers import WanImageToVideoPipeline

    base, tiny = get_card("wan2.2-i2v-a14b"), get_card("tiny-wan2.2-a14b")
    dit = {**tiny.components["transformer"].config, "in_channels": 36}
    components = {name: spec.model_copy(update={"config": dit if name.startswith("transformer") else tiny.components[name].config,
                                                "dtype": "fp32"})
                  for name, spec in base.components.items()}  # fmt: skip
    card = base.model_copy(update={"card_id": "tiny-wan2.2-i2v-a14b", "components": components, "seed": 0,
                                   "recipe": base.recipe.model_copy(update={"precision": "fp32"}),
                                   "shapes": tiny.shapes})  # fmt: skip
    engine = Engine.from_card(card, device="cpu")
    folder = saved_pipeline(WanImageToVideoPipeline, load_components(card, None, torch.device("cpu")), tmp_path / "checkpoint",
                            scheduler=diffusers_scheduler(card.recipe.sampler), boundary_ratio=card.recipe.boundary_ratio)  # fmt: skip
    pipe = reference_pipeline(WanImageToVideoPipeline, folder)
    assert_shares_no_storage(engine, pipe)
    image = PIL.Image.fromarray(np.random.default_rng(2).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    positive, negative = embeds(5, tiny)
    reference = pipe(image=image, prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=3.5,
                     guidance_scale_2=2.5, generator=torch.Generator().manual_seed(4), output_type="latent",
                     num_inference_steps=4, **SHAPE).frames  # fmt: skip
    [result] = engine.generate([Request(image=image, prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=3.5,
                                        guidance_scale_2=2.5, seed=4, output_type="latent", num_inference_steps=4, **SHAPE)])  # fmt: skip
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)
