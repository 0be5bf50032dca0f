"""TeaCache on FLUX, decided from each step's own data: on tiny-flux it equals TeaCache4FLUX's
`teacache_forward` (ali-vilab/TeaCache, TeaCache4FLUX/teacache_flux.py, transcribed below onto
diffusers' FluxTransformer2DModel.forward, 0.42.1) run by FluxPipeline on the same weights (latents,
and which denoiser calls ran their blocks) at two thresholds that decide differently; cached TeaCache
and uncached FLUX requests together equal each alone; the compiled probe and residual steps equal
eager; the settings resolve their signal from the sections and a state saved between the probe and
the second launch resumes unchanged."""

from __future__ import annotations

from types import MethodType

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from fvgraph.caching.residual_steps import RESIDUAL_KINDS
from fvgraph.caching.tea_cache import TeaCacheSettings
from fvgraph.caching.tea_probe_steps import PROBE_KINDS, TeaProbeState
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.loops.flux_loop import FluxState
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request
from cache_helpers import run_together_and_alone
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

STEPS = 10
PROMPT = {"prompt": "a red fox in snow", "guidance_scale": 3.5, "max_sequence_length": 32}  # FLUX.1-dev: one call per step
TRUE_CFG = {**PROMPT, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
SHAPE = {"height": 64, "width": 64, "num_inference_steps": STEPS}
# On tiny-flux (seed 5) with the published FLUX.1-dev polynomial, TeaCache4FLUX runs the blocks in
# 6 of 10 calls at 0.3 and in 3 of 10 at 1.0.
THRESHOLDS = {0.3: 6, 1.0: 3}
REUSE_KINDS = {RESIDUAL_KINDS[(cfg, True)] for cfg in (False, True)}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card("tiny-flux", device="cpu")


# -- the reference: TeaCache4FLUX/teacache_flux.py's teacache_forward, transcribed onto diffusers'
#    FluxTransformer2DModel.forward (0.42.1); its state lives on the model, as there.


def enable_reference_teacache(transformer, num_steps: int, threshold: float, coefficients) -> list[bool]:
    """Install the published forward; returns, filled as calls happen, whether each call computed."""
    transformer.cnt, transformer.num_steps, transformer.rel_l1_thresh = 0, num_steps, threshold
    transformer.coefficients, transformer.should_calc_log = coefficients, []
    transformer.accumulated_rel_l1_distance = 0
    transformer.previous_modulated_input = transformer.previous_residual = None
    transformer.forward = MethodType(reference_teacache_forward, transformer)
    return transformer.should_calc_log


def reference_teacache_forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                               img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None, return_dict=True):  # fmt: skip
    hidden_states = self.x_embedder(hidden_states)
    timestep = timestep.to(hidden_states.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(hidden_states.dtype) * 1000
    temb = self.time_text_embed(timestep, pooled_projections) if guidance is None else self.time_text_embed(timestep, guidance, pooled_projections)
    encoder_hidden_states = self.context_embedder(encoder_hidden_states)
    image_rotary_emb = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))

    inp = hidden_states.clone()
    temb_ = temb.clone()
    modulated_inp, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.transformer_blocks[0].norm1(inp, emb=temb_)
    if self.cnt == 0 or self.cnt == self.num_steps - 1:
        should_calc = True
        self.accumulated_rel_l1_distance = 0
    else:
        rescale_func = np.poly1d(self.coefficients)
        self.accumulated_rel_l1_distance += rescale_func(
            ((modulated_inp - self.previous_modulated_input).abs().mean() / self.previous_modulated_input.abs().mean()).cpu().item()
        )
        if self.accumulated_rel_l1_distance < self.rel_l1_thresh:
            should_calc = False
        else:
            should_calc = True
            self.accumulated_rel_l1_distance = 0
    self.previous_modulated_input = modulated_inp
    self.cnt += 1
    if self.cnt == self.num_steps:
        self.cnt = 0
    self.should_calc_log.append(should_calc)

    if not should_calc:
        hidden_states += self.previous_residual
    else:
        ori_hidden_states = hidden_states.clone()
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                                         temb=temb, image_rotary_emb=image_rotary_emb)  # fmt: skip
        for block in self.single_transformer_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                                         temb=temb, image_rotary_emb=image_rotary_emb)  # fmt: skip
        self.previous_residual = hidden_states - ori_hidden_states
    hidden_states = self.norm_out(hidden_states, temb)
    output = self.proj_out(hidden_states)
    return (output,) if not return_dict else Transformer2DModelOutput(sample=output)


def _reference(card, threshold: float) -> tuple[torch.Tensor, list[bool]]:
    """FluxPipeline with the published forward on a fresh copy of the card's seeded weights."""
    c = load_components(card, None, torch.device("cpu"))
    parts = {name: module for name, module in c.modules().items()
             if name in ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")}  # fmt: skip
    pipe = FluxPipeline(scheduler=diffusers_scheduler(card.recipe.sampler), **parts)
    pipe.set_progress_bar_config(disable=True)
    calls = enable_reference_teacache(pipe.transformer, STEPS, threshold, card.recipe.teacache_coefficients.modulated_input)
    packed = pipe(generator=torch.Generator().manual_seed(5), output_type="latent", **PROMPT, **SHAPE).images
    return FluxPipeline._unpack_latents(packed, SHAPE["height"], SHAPE["width"], pipe.vae_scale_factor).unsqueeze(2), calls


def _ours(engine, threshold: float, text: dict = PROMPT):
    """The result, and per step whether its blocks ran (the kind of its second launch)."""
    kinds: list[str] = []
    [result] = engine.generate([Request(seed=5, output_type="latent", cache={"method": "teacache", "threshold": threshold},
                                        **text, **SHAPE)], on_result=lambda state, plan, result: kinds.append(plan.kind))  # fmt: skip
    assert result.ok, result.error
    wholes = [kind for kind in kinds if kind.startswith("denoise") and kind not in PROBE_KINDS.values()]
    return result, [kind not in REUSE_KINDS for kind in wholes], kinds


@pytest.mark.parametrize("threshold", sorted(THRESHOLDS))
def test_teacache_matches_the_published_flux_teacache_forward(engine, threshold):
    reference, theirs = _reference(engine.card, threshold)
    result, ours, kinds = _ours(engine, threshold)
    assert len(theirs) == STEPS and sum(theirs) == THRESHOLDS[threshold]
    assert ours == theirs  # the same denoiser calls ran their blocks
    assert {k: result.cache[k] for k in ("computed", "reused")} == {"computed": sum(theirs), "reused": STEPS - sum(theirs)}
    assert kinds.count(PROBE_KINDS[False]) == STEPS - 1  # every step but the last, which computes regardless
    assert_matches_reference(result.latents, reference)
    assert result.cache["flops_uncached"] > result.cache["flops"] > 0


def test_true_cfg_shares_one_decision_per_step(engine):
    result, ours, _ = _ours(engine, 0.3, TRUE_CFG)
    assert not all(ours) and any(ours)
    assert result.cache["computed"] == 2 * sum(ours) and result.cache["reused"] == 2 * (STEPS - sum(ours))


def test_the_signal_comes_from_the_sections_and_the_card_carries_the_published_polynomial(engine):
    assert get_card("tiny-flux").recipe.teacache_coefficients == get_card("flux.1-dev").recipe.teacache_coefficients
    assert get_card("flux.1-dev").recipe.teacache_coefficients.modulated_input[0] == 4.98651651e02
    settings = TeaCacheSettings(threshold=0.3).for_sections(engine.loop.sections)
    assert settings.signal == "modulated_input" and settings.state_type is TeaProbeState
    assert TeaCacheSettings().state_type is not TeaProbeState  # Wan's planned TeaCache, unchanged
    for cache, field in (({"signal": "timestep"}, "cache.signal"), ({"use_ret_steps": True}, "cache.use_ret_steps")):
        [refused] = engine.generate([Request(cache={"method": "teacache", **cache}, **PROMPT, **SHAPE)])
        assert refused.status == "rejected" and refused.error.startswith(f"{field}:"), refused.error


def test_teacache_and_uncached_flux_requests_together_equal_each_alone(engine):
    requests = [
        Request(seed=1, cache={"method": "teacache", "threshold": 0.3}, **PROMPT, **SHAPE),
        Request(seed=2, **TRUE_CFG, **SHAPE),
        Request(seed=3, cache={"method": "teacache", "threshold": 0.6}, **TRUE_CFG, **SHAPE),
        Request(seed=4, cache={"method": "teacache", "threshold": 1.0}, prompt="a blue bird", guidance_scale=2.0,
                height=64, width=64, num_inference_steps=6),
        Request(seed=5, **PROMPT, **SHAPE),
    ]  # fmt: skip
    requests = [r.model_copy(update={"output_type": "latent"}) for r in requests]
    together = run_together_and_alone(engine, requests)
    assert together[0].cache["reused"] > 0 and together[2].cache["reused"] > 0


def test_compiled_teacache_steps_equal_eager(engine):
    compiled_engine = Engine.from_card("tiny-flux", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"))
    requests = [Request(seed=7, output_type="latent", cache={"method": "teacache", "threshold": 0.6}, **TRUE_CFG, **SHAPE),
                Request(seed=8, output_type="latent", cache={"method": "teacache", "threshold": 0.3}, **PROMPT, **SHAPE)]  # fmt: skip
    compiled = compiled_engine.generate(requests)  # captured with fullgraph: a graph break fails here
    kinds = {s.step_kind for s in compiled_engine.compiler.signatures}
    assert set(PROBE_KINDS.values()) <= kinds and REUSE_KINDS <= kinds
    for ours, theirs in zip(compiled, engine.generate(requests)):
        assert ours.ok, ours.error
        assert ours.cache == theirs.cache
        assert_within_compiled_noise(ours.latents, theirs.latents)


def test_a_state_saved_between_the_probe_and_a_reuse_resumes_unchanged(engine, tmp_path):
    request = Request(seed=5, output_type="latent", cache={"method": "teacache", "threshold": 0.3}, **PROMPT, **SHAPE)
    [whole] = engine.generate([request])
    state = engine.start(request)
    while state.caching.compute != [False]:  # stop after a probe that decided to reuse
        engine.step(state)
    state.save(tmp_path / "state.pt")
    resumed = engine.finish(engine.resume(FluxState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, whole.latents)
    assert resumed.cache == whole.cache
