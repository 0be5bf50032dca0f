"""TeaCache for Wan as an interceptor: settings validated, decisions and latents as TeaCache4Wan2.1's
own forward (transcribed below onto diffusers' WanTransformer3DModel and run through WanPipeline) on
the same weights, compiled equal to eager, and requests with different methods interleaved or
resumed unchanged."""

from types import MethodType

import numpy as np
import pytest
import torch
from diffusers import WanPipeline
from pydantic import ValidationError

from fvgraph.card import ModelCard
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.models.components import diffusers_scheduler
from fvgraph.loops.t2v_loop import T2VState
from fvgraph.caching.tea_cache import TeaCacheSettings
from fvgraph.request import Request, RequestRejected
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from cache_helpers import block_calls as _block_calls, run_together_and_alone
from conftest import embeds
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

STEPS = 10
SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": STEPS}
# Two settings with different schedules on tiny-wan's random weights. The published polynomials are
# fitted to the released models' embeddings: on tiny-wan's the projection's one is negative, so with
# use_ret_steps every step after the first five reuses. The embedding's one is far above any threshold
# there, so the other setting scales the raw relative L1 change (0.58-1.10 per step here) instead.
SETTINGS = {
    "ret_steps_published": {"method": "teacache", "threshold": 0.2, "use_ret_steps": True},
    "embedding_scaled": {"method": "teacache", "threshold": 0.3, "coefficients": [0.25, 0.0]},
}


def _request(seed: int, cache: dict | None, guidance_scale: float = 5.0) -> Request:
    positive, negative = embeds(seed, get_card("tiny-wan"))
    return Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale, seed=seed,
                   output_type="latent", cache=cache, **SHAPE)  # fmt: skip



# -- the reference: TeaCache4Wan2.1/teacache_generate.py's teacache_forward and its settings, transcribed
#    onto diffusers' WanTransformer3DModel.forward (0.42.1); its state lives on the model, as there.


def enable_reference_teacache(transformer, num_steps: int, threshold: float, use_ret_steps: bool, coefficients) -> None:
    transformer.cnt, transformer.num_steps, transformer.teacache_thresh = 0, num_steps * 2, threshold
    transformer.use_ref_steps, transformer.coefficients = use_ret_steps, coefficients
    transformer.ret_steps = 5 * 2 if use_ret_steps else 1 * 2
    transformer.cutoff_steps = num_steps * 2 if use_ret_steps else num_steps * 2 - 2
    transformer.accumulated_rel_l1_distance_even = transformer.accumulated_rel_l1_distance_odd = 0
    transformer.forward = MethodType(reference_teacache_forward, transformer)


def _should_calc(self, parity: str, modulated_inp: torch.Tensor) -> bool:
    acc, prev = f"accumulated_rel_l1_distance_{parity}", f"previous_e0_{parity}"
    if self.cnt < self.ret_steps or self.cnt >= self.cutoff_steps:
        should_calc = True
        setattr(self, acc, 0)
    else:
        rescale_func = np.poly1d(self.coefficients)
        previous = getattr(self, prev)
        setattr(self, acc, getattr(self, acc) + rescale_func(((modulated_inp - previous).abs().mean() / previous.abs().mean()).cpu().item()))
        if getattr(self, acc) < self.teacache_thresh:
            should_calc = False
        else:
            should_calc = True
            setattr(self, acc, 0)
    setattr(self, prev, modulated_inp.clone())
    return should_calc


def reference_teacache_forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                               return_dict=True, attention_kwargs=None):  # fmt: skip
    batch_size, _, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size
    rotary_emb = self.rope(hidden_states)
    hidden_states = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
    temb, timestep_proj, encoder_hidden_states, _ = self.condition_embedder(timestep, encoder_hidden_states, None)
    timestep_proj = timestep_proj.unflatten(1, (6, -1))
    # TeaCache: even calls are the cond branch, odd ones the uncond branch
    parity = "even" if self.cnt % 2 == 0 else "odd"
    should_calc = _should_calc(self, parity, timestep_proj if self.use_ref_steps else temb)
    if not should_calc:
        hidden_states = hidden_states + getattr(self, f"previous_residual_{parity}")
    else:
        ori_x = hidden_states.clone()
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
        setattr(self, f"previous_residual_{parity}", hidden_states - ori_x)
    self.cnt = 0 if self.cnt + 1 >= self.num_steps else self.cnt + 1
    shift, scale = (self.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden_states = (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
    hidden_states = self.proj_out(hidden_states)
    hidden_states = hidden_states.reshape(batch_size, num_frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return (hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


# -- tests


def test_teacache_settings_are_validated_naming_the_field(tiny_card):
    with pytest.raises(ValidationError, match=r"cache.use_ret_step: Extra inputs are not permitted"):
        Request(prompt="x", cache={"method": "teacache", "use_ret_step": True})
    with pytest.raises(ValidationError, match=r"cache.threshold: Input should be greater than or equal to 0"):
        Request(prompt="x", cache={"method": "teacache", "threshold": -0.1})
    with pytest.raises(ValidationError, match=r"cache.coefficients: Tuple should have at least 1 item"):
        Request(prompt="x", cache={"method": "teacache", "coefficients": []})
    with pytest.raises(ValidationError, match=r"cache.coefficients.1: Input should be a finite number"):
        Request(prompt="x", cache={"method": "teacache", "coefficients": [1.0, float("inf")]})
    settings = Request(prompt="x", cache={"method": "teacache"}).cache
    assert settings == TeaCacheSettings(threshold=0.2, use_ret_steps=False, coefficients=None)
    assert settings.check_card(tiny_card) is None
    bare = ModelCard.model_validate({**tiny_card.model_dump(), "recipe": {**tiny_card.recipe.model_dump(), "teacache_coefficients": None}})
    assert settings.check_card(bare)[0] == "cache.coefficients"
    assert "declares no TeaCache coefficients" in settings.check_card(bare)[1]
    assert TeaCacheSettings(coefficients=[1.0, 0.0]).check_card(bare) is None


def test_the_cards_carry_the_published_polynomials():
    assert get_card("tiny-wan").recipe.teacache_coefficients == get_card("wan2.1-t2v-1.3b").recipe.teacache_coefficients
    assert get_card("wan2.1-t2v-14b").recipe.teacache_coefficients.timestep_embedding[0] == -5784.54975374


def test_a_card_without_coefficients_rejects_teacache_naming_the_field(tiny_engine):
    loop = tiny_engine.loop
    bare = ModelCard.model_validate({**loop.card.model_dump(), "recipe": {**loop.card.recipe.model_dump(), "teacache_coefficients": None}})
    other = type(loop)(bare, loop.components)
    with pytest.raises(RequestRejected, match="cache.coefficients: card 'tiny-wan' declares no TeaCache coefficients"):
        other.check_request(_request(0, SETTINGS["ret_steps_published"]))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_latents_and_full_calls_match_the_transcribed_teacache(tiny_engine, name):
    cache = SETTINGS[name]
    c = load_components(tiny_engine.card, None, torch.device("cpu"))  # the same weights, nothing of fvgraph in them
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(tiny_engine.card.recipe.sampler))  # fmt: skip
    published = tiny_engine.card.recipe.teacache_coefficients  # TeaCache4Wan2.1 picks them by use_ret_steps
    coefficients = cache.get("coefficients") or (published.timestep_projection if cache.get("use_ret_steps") else published.timestep_embedding)
    enable_reference_teacache(pipe.transformer, STEPS, cache["threshold"], cache.get("use_ret_steps", False), coefficients)
    request = _request(21, cache)
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
    expected = [step for step in schedule for _branch in ("cond", "uncond")]
    assert not all(expected) and any(expected)
    assert ours == theirs == expected  # the same denoiser calls ran their blocks, in the same order
    assert {k: result.cache[k] for k in ("method", "computed", "reused")} == {"method": "teacache", "computed": sum(expected), "reused": len(expected) - sum(expected)}
    assert_matches_reference(result.latents, reference)


def test_the_two_settings_give_different_schedules_planned_when_the_request_starts(tiny_engine):
    embedder = tiny_engine.loop.components.transformer.condition_embedder
    counts, embedder_calls = {}, []
    handle = embedder.register_forward_pre_hook(lambda m, a: embedder_calls.append(a[0].shape))
    try:
        for name, cache in SETTINGS.items():
            state = tiny_engine.start(_request(3, cache))
            counts[name] = sum(state.caching.policy.schedule(STEPS))
    finally:
        handle.remove()
    assert embedder_calls == [torch.Size([1])] * STEPS * 2  # once per timestep of each request, before its first step
    assert counts == {"ret_steps_published": 5, "embedding_scaled": 6}  # CCCCCRRRRR and CRCRCRCRCC


def _mixed() -> list[Request]:
    magcache = {"method": "magcache", "threshold": 0.06, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}
    return [_request(1, SETTINGS["embedding_scaled"]), _request(2, None), _request(3, SETTINGS["ret_steps_published"]),
            _request(4, magcache), _request(5, SETTINGS["embedding_scaled"], 1.0)]  # fmt: skip


def test_teacache_magcache_and_uncached_requests_together_equal_each_alone(tiny_engine):
    requests = _mixed()
    together = run_together_and_alone(tiny_engine, requests)
    assert together[4].cache["computed"] + together[4].cache["reused"] == STEPS  # no CFG: one call per step


def test_compiled_teacache_steps_equal_eager_and_add_no_recompile(tiny_engine):
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="aot_eager"))
    requests = [_request(1, SETTINGS["embedding_scaled"])]  # both kinds, one batch size: two compiles
    compiled = engine.generate(requests)
    with engine.counters.expect(compiles=0):
        again = engine.generate(requests)
    assert {signature.step_kind for signature in engine.compiler.signatures} == {"denoise_cfg_keep", "denoise_cfg_reuse"}
    eager = tiny_engine.generate(requests)
    for a, b, c in zip(compiled, again, eager):
        assert a.ok and b.ok and a.cache == c.cache
        assert_within_compiled_noise(a.latents, c.latents)
        assert torch.equal(a.latents, b.latents)


def test_a_state_saved_between_a_reuse_and_a_keep_resumes_unchanged(tiny_engine, tmp_path):
    request = _request(9, SETTINGS["embedding_scaled"])
    [whole] = tiny_engine.generate([request])
    state = tiny_engine.start(request)
    schedule = state.caching.policy.schedule(STEPS)
    stop = next(i for i in range(1, STEPS) if not schedule[i - 1] and schedule[i])  # after a reuse, before a keep
    while state.step_index < stop:
        tiny_engine.step(state)
    state.save(tmp_path / "state.pt")
    resumed = tiny_engine.finish(tiny_engine.resume(T2VState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, whole.latents)
    assert resumed.cache == whole.cache
