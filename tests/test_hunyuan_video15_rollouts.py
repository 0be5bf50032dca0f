"""RL rollouts on HunyuanVideo-1.5 (tiny-hunyuanvideo1.5): Flow-GRPO's SDE step (docs/rollouts.md) on
the family's denoise step. A rollout equals HunyuanVideo15Pipeline stepping flow_grpo's
`sde_step_with_logprob` (transcribed in tests/test_rollouts.py) on an untouched copy of the weights,
at the checkpoint's shift; a grouped rollout's samples equal each run alone, bit for bit at -O0."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance

from fvgraph.cards import get_card
from fvgraph.engine.engine import Engine
from fvgraph.models.components import load_components
from fvgraph.request import Request
from reference_helpers import assert_matches_reference, assert_shares_no_storage
from test_rollouts import FlowGrpoScheduler

CARD = "tiny-hunyuanvideo1.5"
SHAPE = dict(num_inference_steps=3, num_frames=5, height=32, width=48)
TEXT = dict(prompt='a sign saying "hi" at night', negative_prompt="blurry")


class SigmasFlowGrpoScheduler(FlowGrpoScheduler):
    """FlowGrpoScheduler as HunyuanVideo15Pipeline calls it: the pipeline hands its own sigmas to
    `set_timesteps`; the rollout samples on the scheduler's N-step schedule at the card's shift, as
    Flow-GRPO (and fvgraph's rollouts on every family) do."""

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None):
        super().set_timesteps(len(sigmas) if num_inference_steps is None else num_inference_steps, device)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card(CARD, device="cpu")


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_rollout_equals_flow_grpo_sampling_on_the_pipeline(engine, guidance_scale):
    card = get_card(CARD)
    c = load_components(card, None, torch.device("cpu"))
    pipe = HunyuanVideo15Pipeline(transformer=c.transformer, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                                  text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
                                  scheduler=FlowMatchEulerDiscreteScheduler(**card.recipe.sampler.config),
                                  guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))  # fmt: skip
    assert_shares_no_storage(engine, pipe)
    generator = torch.Generator().manual_seed(4)
    shift = card.recipe.sampler.config["shift"]  # 7.0: a wrong shift moves every sigma
    pipe.scheduler = SigmasFlowGrpoScheduler(shift, 0.7, generator)
    pipe(generator=generator, output_type="latent", **TEXT, **SHAPE)
    [result] = engine.generate([Request(seed=4, rollout={"noise_level": 0.7}, output_type="latent", guidance_scale=guidance_scale,
                                        **TEXT, **SHAPE)])  # fmt: skip
    assert result.ok, result.error
    record = result.record
    assert record.latents.shape[0] == SHAPE["num_inference_steps"] + 1
    assert_matches_reference(record.latents, torch.cat(pipe.scheduler.latents))
    torch.testing.assert_close(record.log_probs, torch.cat(pipe.scheduler.log_probs), atol=1e-4, rtol=1e-5)
    assert torch.equal(record.timesteps.float(), pipe.scheduler.timesteps.float())
    assert torch.equal(result.latents, record.latents[-1:])


def test_a_group_batched_equals_each_sample_alone_bit_for_bit(engine):
    kinds = []
    records = engine.rollout([TEXT["prompt"]], group_size=3, seed=11, negative_prompt=TEXT["negative_prompt"], guidance_scale=4.0,
                             on_step=lambda s, kind: kinds.append(kind), **SHAPE)  # fmt: skip
    assert len(records) == 3 and {r.group for r in records} == {0} and len({r.seed for r in records}) == 3
    # each sample encodes its text (the family's requests carry texts, not embeddings), then the SDE steps batch
    assert kinds.count("text_encode") == 3 and kinds.count("denoise_sde_cfg") == 3 * SHAPE["num_inference_steps"]
    assert not torch.equal(records[0].latents, records[1].latents)
    for record in records:
        [alone] = engine.generate([Request(seed=record.seed, rollout={"noise_level": 0.7}, output_type="latent", guidance_scale=4.0,
                                           **TEXT, **SHAPE)])  # fmt: skip
        assert torch.equal(alone.record.latents, record.latents) and torch.equal(alone.record.log_probs, record.log_probs)
        assert torch.isfinite(record.log_probs).all()
