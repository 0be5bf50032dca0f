"""What a family provides for step caching, and what a caching state is between steps.

Wan's and FLUX's sections, run in order, equal diffusers' WanTransformer3DModel and
FluxTransformer2DModel forwards bit for bit (the contract every caching method relies on); a request's caching state is one typed field of its loop
state that saves as plain values and is read back field by field, refusing what it could not have
written."""

import pytest
import torch

from fvgraph.caching.methods import METHODS, load_state, step_families
from fvgraph.caching.state import StepCachingState
from fvgraph.cards import get_card
from fvgraph.contract.step_kind import Role
from fvgraph.loops.t2v_loop import STEP_KINDS, T2VState
from fvgraph.models.wan_sections import WanSections
from fvgraph.request import Request
from conftest import embeds

SECTIONS = ("conditions", "embed", "first_block", "remaining_blocks", "stream", "project_out", "token_shape", "hidden_shape",
            "token_dtype", "attention_shape")


def test_wans_sections_in_order_equal_its_forward(tiny_engine):
    transformer = tiny_engine.loop.components.transformer
    sections = WanSections(transformer)
    assert all(hasattr(sections, name) for name in SECTIONS)
    torch.manual_seed(0)
    latents = torch.randn(2, 16, 3, 8, 8)
    text = torch.randn(2, 16, transformer.config.text_dim)
    timestep = torch.tensor([999.0, 500.0])
    with torch.no_grad():
        expected = transformer(latents, timestep, text, return_dict=False)[0]
        tokens = sections.embed(latents, timestep, **sections.conditions({"prompt_embeds": text}, 0))
        hidden = sections.remaining_blocks(sections.first_block(tokens.hidden_states, tokens), tokens)
        got = sections.project_out(sections.stream(hidden, tokens), tokens)
    assert torch.equal(got, expected)
    assert sections.token_shape(latents[:1]) == sections.hidden_shape(latents[:1], 16) == (1, *tokens.hidden_states.shape[1:])
    assert sections.token_dtype == tokens.hidden_states.dtype


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_fluxs_sections_in_order_equal_its_forward(guidance):
    """FluxPipeline's call of the transformer (packing, ids, t / 1000) and the forward, cut at its blocks."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from fvgraph.models.flux_sections import FluxSections

    config = {**get_card("tiny-flux").components["transformer"].config, "guidance_embeds": guidance}
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(**config).eval()
    sections = FluxSections(transformer, vae_spatial=8)
    assert all(hasattr(sections, name) for name in SECTIONS)
    latents = torch.randn(2, config["in_channels"] // 4, 1, 6, 8)  # one-frame latents, 12 packed tokens
    inputs = {"negative_prompt_embeds": torch.randn(2, 5, config["joint_attention_dim"]),
              "negative_pooled_prompt_embeds": torch.randn(2, config["pooled_projection_dim"])}  # fmt: skip
    if guidance:
        inputs["guidance"] = torch.tensor([3.5, 2.0])
    timestep = torch.tensor([990.0, 400.0])
    with torch.no_grad():
        packed = FluxPipeline._pack_latents(latents[:, :, 0], 2, latents.shape[1], 6, 8)
        img_ids = FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
        out = transformer(packed, inputs["negative_prompt_embeds"], inputs["negative_pooled_prompt_embeds"], timestep / 1000,
                          img_ids, torch.zeros(5, 3), inputs.get("guidance"), return_dict=False)[0]  # fmt: skip
        expected = FluxPipeline._unpack_latents(out, 48, 64, 8).unsqueeze(2)
        tokens = sections.embed(latents, timestep, **sections.conditions(inputs, 1))
        hidden = sections.remaining_blocks(sections.first_block(tokens.hidden_states, tokens), tokens)
        got = sections.project_out(sections.stream(hidden, tokens), tokens)
    assert torch.equal(got, expected)
    assert sections.hidden_shape(latents[:1], 5) == (1, *hidden.shape[1:]) and hidden.shape[1] == 5 + 12
    assert sections.token_shape(latents[:1]) == (1, *sections.stream(hidden, tokens).shape[1:])


def test_every_caching_kind_derives_from_the_loops_denoise_kind_and_declares_what_it_adds():
    for family in step_families("timestep"):  # Wan's: TeaCache planned, no probe
        for name in family.step_kinds({False: STEP_KINDS["denoise"], True: STEP_KINDS["denoise_cfg"]}):
            kind = STEP_KINDS[name]
            assert kind.component == "transformer" and kind.compiled
            assert kind.constants <= STEP_KINDS["denoise_cfg"].constants  # text and guidance stay in place
            added = set(kind.inputs) - set(STEP_KINDS["denoise_cfg"].inputs)
            assert all(kind.inputs[n] in (Role.CARRIED, Role.STEP) for n in added), name
    assert STEP_KINDS["denoise_cfg_first_block"].host_outputs == ("first_block_change",)
    with pytest.raises(ValueError, match="step kind 'denoise' declares no input 'kept_0'"):
        STEP_KINDS["denoise"].input_role("kept_0")


def _cached_state(tiny_engine, cache: dict, steps: int = 4) -> T2VState:
    positive, negative = embeds(3, get_card("tiny-wan"))
    state = tiny_engine.start(Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0, seed=3,
                                      num_inference_steps=6, num_frames=1, height=32, width=32, output_type="latent",
                                      cache=cache))  # fmt: skip
    for _ in range(steps):
        tiny_engine.step(state)
    return state


CACHES = {
    "magcache": {"method": "magcache", "threshold": 0.5, "retention_ratio": 0.2, "mag_ratios": [1.0] + [0.99] * 5},
    "taylorseer": {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 2, "max_order": 1},
    "fbcache": {"method": "fbcache", "threshold": 0.5},
}


@pytest.mark.parametrize("method", sorted(CACHES))
def test_a_caching_state_saves_as_plain_values_and_reads_back_the_same(tiny_engine, method):
    state = _cached_state(tiny_engine, CACHES[method])
    caching = state.caching
    assert isinstance(caching, METHODS[method].state_type) and isinstance(caching, StepCachingState)
    saved = caching.saved()
    assert saved["settings"]["method"] == method and "policy" not in saved and "flops" not in saved
    back = load_state(saved)
    assert type(back) is type(caching) and back.settings == caching.settings and back.memo == caching.memo
    assert all(torch.equal(a, b) for a, b in zip(back.kept, caching.kept)) and back.counts == caching.counts


def test_a_saved_caching_state_is_read_field_by_field(tiny_engine, tmp_path):
    saved = _cached_state(tiny_engine, CACHES["magcache"]).caching.saved()
    with pytest.raises(ValueError, match=r"caching \(magcache\): unknown field bogus"):
        load_state({**saved, "bogus": 1})
    with pytest.raises(ValueError, match=r"caching \(magcache\): field kept must be list\[torch.Tensor\], got str"):
        load_state({**saved, "kept": "residuals"})
    with pytest.raises(ValueError, match=r"cache.method='nocache' is not a known method"):
        load_state({**saved, "settings": {"method": "nocache"}})
    with pytest.raises(ValueError, match="settings: must name a caching method, not 'none'"):
        load_state({**saved, "settings": {"method": "none"}})
    state = _cached_state(tiny_engine, CACHES["magcache"])
    state.caching.memo = {"acc": 0.0}  # another method's accumulators
    state.save(tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"caching.memo: must hold exactly \['err', 'ratio', 'skipped'\] for method 'magcache'"):
        tiny_engine.resume(T2VState.load(tmp_path / "state.pt"))


def _saved_and_broken(tiny_engine, tmp_path, cache: dict, breaks) -> T2VState:
    state = _cached_state(tiny_engine, cache)
    breaks(state)
    state.save(tmp_path / "state.pt")
    return T2VState.load(tmp_path / "state.pt")


@pytest.mark.parametrize("method, breaks, message", [
    ("magcache", lambda s: setattr(s.caching, "kept", [k[:, :1] for k in s.caching.kept]),
     r"caching.kept\[0\]: must be torch.float32 of shape \[1, 4, 32\], got torch.float32 of shape \[1, 1, 32\]"),
    ("magcache", lambda s: setattr(s.caching, "kept", [k.double() for k in s.caching.kept]), r"caching.kept\[0\]: must be torch.float32"),
    ("taylorseer", lambda s: setattr(s.caching, "kept", [k[:1, :1, :1, :1, :1] for k in s.caching.kept]),
     r"caching.kept\[0\]: must be torch.bfloat16 of shape \[1, 16, 1, 4, 4\]"),
    ("fbcache", lambda s: setattr(s.caching, "first", [f[:, :1] for f in s.caching.first]), r"caching.first\[0\]: must be"),
    ("magcache", lambda s: s.caching.counts.update(reused=-1), r"caching.counts: must hold the ints >= 0"),
    ("magcache", lambda s: s.caching.counts.update(extra=2), r"caching.counts: must hold the ints >= 0"),
    ("magcache", lambda s: s.caching.memo.update(ratio="one"), r"caching.memo: ratio='one' must be a finite number"),
])  # fmt: skip
def test_a_resumed_caching_state_is_checked_against_what_the_steps_produce(tiny_engine, tmp_path, method, breaks, message):
    """Kept tensors cut to a broadcastable shape or widened would run and give wrong latents (or fail
    inside the step); counts and accumulators echo into Result.cache and the decisions."""
    with pytest.raises(ValueError, match=message):
        tiny_engine.resume(_saved_and_broken(tiny_engine, tmp_path, CACHES[method], breaks))


@pytest.mark.parametrize("name, breaks", [
    ("timesteps", lambda s: setattr(s, "timesteps", s.timesteps.flip(0))),
    ("coeffs", lambda s: setattr(s, "coeffs", s.coeffs * 1.001)),
    ("prompt_embeds", lambda s: setattr(s, "prompt_embeds", s.prompt_embeds.half())),
])  # fmt: skip
def test_a_resumed_schedule_is_the_samplers_and_embeddings_are_in_the_denoisers_dtype(tiny_engine, tmp_path, name, breaks):
    with pytest.raises(ValueError, match=rf"state of request .*: {name}: "):
        tiny_engine.resume(_saved_and_broken(tiny_engine, tmp_path, CACHES["magcache"], breaks))
