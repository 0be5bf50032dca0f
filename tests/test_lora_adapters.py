"""LoRA adapters chosen per request, checked against diffusers' own LoRA loading on untouched weights.

The LoRA files are written by diffusers and peft (`WanPipeline.save_lora_weights` of a random peft
adapter, its LoraConfig as metadata) and in musubi-tuner's key layout; diffusers' side loads them
with `load_lora_weights` + `set_adapters` into a pipeline built from its own copy of the seeded
weights. fvgraph loads the same files into its slots.
"""

import pytest
import torch
from diffusers import WanPipeline

import fvgraph
from conftest import embeds
from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.slots import LoraSlots
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.runtime.adapter_variant import ROWS_FIRST
from fvgraph.runtime.buckets import BucketSpec
from lora_files import fresh_transformer, musubi_dims, musubi_lora, peft_lora
from reference_helpers import assert_matches_reference

SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 4}
SMALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 3}
SLOTS = LoraSlots(max_loras=4, max_lora_rank=8, max_loras_per_request=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return {
        "a": peft_lora(d / "a", 1, ["to_q", "to_k", "to_v", "to_out.0"], rank=4, alpha=8.0),  # scaling 2
        "b": musubi_lora(d / "b.safetensors", 2, 2, musubi_dims(fresh_transformer())),  # alpha 2 / rank 4
        "kv": peft_lora(d / "kv", 3, ["attn2.to_k", "attn2.to_v"], rank=4, alpha=4.0),  # the hoisted K/V only
    }


@pytest.fixture(scope="module")
def engine(files):
    return Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"], "b": files["b"]}, lora_slots=SLOTS)


def _request(seed=7, loras=None, shape=SHAPE, **extra):
    positive, negative = embeds(11, get_card("tiny-wan"))
    return fvgraph.Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0, seed=seed,
                           output_type="latent", loras=loras, **shape, **extra)  # fmt: skip


def _latents(engine, *requests):
    results = engine.generate(list(requests))
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.latents for r in results]


def _reference(files, adapters: dict[str, float]):
    """diffusers' WanPipeline on its own copy of the weights, with `adapters` loaded and set."""
    card = get_card("tiny-wan")
    c = load_components(card, None, torch.device("cpu"))
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip
    for name in adapters:
        pipe.load_lora_weights(str(files[name]), adapter_name=name)
    if adapters:
        pipe.set_adapters(list(adapters), list(adapters.values()))
    positive, negative = embeds(11, card)
    return pipe(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(7), output_type="latent", **SHAPE).frames  # fmt: skip


def test_adapters_at_their_scales_equal_diffusers_load_lora_weights_and_set_adapters(engine, files):
    results = engine.generate([_request(), _request(loras={"a": 0.7}), _request(loras={"a": 0.7, "b": 0.5})])
    base, one, both = (r.latents for r in results)
    assert [r.provenance["loras"] for r in results] == [{}, {"a": 0.7}, {"a": 0.7, "b": 0.5}]
    assert_matches_reference(base, _reference(files, {}))
    reference_one = _reference(files, {"a": 0.7})
    assert_matches_reference(one, reference_one)
    assert (reference_one - base).abs().max() > 0.1  # the adapter moves the result far beyond the tolerance
    reference_both = _reference(files, {"a": 0.7, "b": 0.5})  # b is a musubi-format file, converted by diffusers
    assert_matches_reference(both, reference_both)
    assert (reference_both - reference_one).abs().max() > 0.1


def test_a_merged_adapter_equals_diffusers_and_changes_the_weights_version(files, engine):
    merged = Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"]}, merge_loras={"a": 0.7})
    assert merged.adapters.store is None and merged.loras()[0]["merged_scale"] == 0.7
    assert merged.loop.components.weights_version != engine.loop.components.weights_version
    [result] = merged.generate([_request(loras={"a": 0.7})])  # naming it at its merged scale is accepted
    assert_matches_reference(result.latents, _reference(files, {"a": 0.7}))
    assert result.provenance["merged_loras"] == {"a": 0.7} and result.provenance["loras"] == {}
    assert result.provenance["weights_version"] == merged.loop.components.weights_version
    [other] = merged.generate([_request(loras={"a": 0.5})])
    assert other.status == "rejected" and "merged into the weights at scale 0.7" in other.error
    with pytest.raises(AdapterError, match="no adapter slots"):
        merged.load_lora("c", files["b"])


def test_a_cross_attention_kv_adapter_reaches_the_projection_cache(files):
    """The LoRA adapts only attn2.to_k / to_v, whose outputs the eager projection cache keeps: serving the
    base weights' K/V to the adapted request would give the base result. (The compiled path's hoisted
    prologue is held to the same adapter in the mixed-batch test below.)"""
    eager = Engine.from_card("tiny-wan", device="cpu", loras={"kv": files["kv"]}, lora_slots=SLOTS)
    uncached = Engine.from_card("tiny-wan", device="cpu", loras={"kv": files["kv"]}, lora_slots=SLOTS, projection_cache_bytes=0)
    base, adapted = _latents(eager, _request(shape=SMALL), _request(loras={"kv": 1.0}, shape=SMALL))  # same prompt: base K/V cached first
    [expected] = _latents(uncached, _request(loras={"kv": 1.0}, shape=SMALL))
    assert torch.equal(adapted, expected) and (adapted - base).abs().max() > 0.1
    assert eager.projection_cache.stats.hits > 0 and eager.projection_cache.stats.misses >= 2 * 2 * 2  # K and V, 2 blocks, each variant


def test_a_batch_of_mixed_adapters_equals_each_request_alone_and_a_new_adapter_compiles_nothing(files):
    mix = [{"a": 0.7}, {"b": 0.5}, {"a": 0.7, "b": 0.5}, None]
    requests = lambda: [_request(seed=7 + i, loras=m, shape=SMALL) for i, m in enumerate(mix)]  # noqa: E731
    eager = Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"], "b": files["b"]}, lora_slots=SLOTS)
    alone = [_latents(eager, r)[0] for r in requests()]
    assert all(torch.equal(x, y) for x, y in zip(alone, _latents(eager, *requests())))  # -O0: bit for bit
    assert len({tuple(x.flatten()[:8].tolist()) for x in alone}) == 4
    compiled = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                loras={"a": files["a"], "b": files["b"]}, lora_slots=SLOTS,
                                buckets=BucketSpec(batch_sizes=(4,)))  # fmt: skip
    compiled.warmup(requests())  # then fail_on_recompile
    tolerance = compiled.card.parity.tolerance("fp32")
    for ours, reference in zip(_latents(compiled, *requests()), alone):
        torch.testing.assert_close(ours, reference, atol=tolerance.atol, rtol=tolerance.rtol)
    compiles, prologues = compiled.counters.compiles, compiled.counters.prologue_runs
    # Fewer adapter rows than the bucket: they run first and alone do the low-rank work (m' = 1, 2);
    # each request still equals itself alone, in the caller's order, and nothing compiles.
    firsts = {dict((n, s) for n, s, _ in sig.inputs).get(ROWS_FIRST, (0,))[0] for sig, _, _ in compiled.executor.runner._graphs}
    assert firsts == {0, 1, 2}
    for order in ([3, 0, 3, 1], [3, 3, 2, 3]):  # indices into mix: [None, a, None, b], [None, None, a+b, None]
        few = [_request(seed=7 + i, loras=mix[i], shape=SMALL) for i in order]
        for ours, i in zip(_latents(compiled, *few), order):
            torch.testing.assert_close(ours, alone[i], atol=tolerance.atol, rtol=tolerance.rtol)
    assert compiled.counters.compiles == compiles
    # A third adapter, while serving (slot storage written in place), on the cross-attention K/V only:
    # the K/V the -O1 prologue hoists must be the adapted ones.
    compiled.load_lora("kv", files["kv"])
    mixed = [_request(seed=1, loras={"kv": 1.0}, shape=SMALL), *requests()[:3]]
    [with_kv, *_] = _latents(compiled, *mixed)
    assert compiled.counters.prologue_runs > prologues and compiled.counters.compiles == compiles
    eager.load_lora("kv", files["kv"])
    expected, base = _latents(eager, mixed[0], _request(seed=1, shape=SMALL))
    torch.testing.assert_close(with_kv, expected, atol=tolerance.atol, rtol=tolerance.rtol)
    assert (expected - base).abs().max() > 0.1


def test_a_batch_runs_the_adapter_width_its_rows_use_each_prepared_at_warmup(files):
    """No adapter row: the step without rows (the base linears alone); rows of one adapter each: one
    place; warmup prepares every width at every bucket, so a frozen engine serves any mix."""
    compiled = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                loras={"a": files["a"], "b": files["b"]}, lora_slots=SLOTS,
                                buckets=BucketSpec(batch_sizes=(1, 2)))  # fmt: skip
    compiled.warmup([_request(shape=SMALL)])  # one request without adapters; then fail_on_recompile
    widths = lambda: {dict((n, s) for n, s, _ in sig.inputs).get("lora_index", (0,))[0]  # noqa: E731
                      for sig, _, _ in compiled.executor.runner._graphs}  # fmt: skip
    assert widths() == {0, 1, 2}
    compiles = compiled.counters.compiles
    mixes = [[None, None], [{"a": 0.7}, None], [{"a": 0.7}, {"b": 0.5}], [{"a": 0.7, "b": 0.5}], [None]]
    for mix in mixes:
        ours = _latents(compiled, *[_request(seed=7 + i, loras=m, shape=SMALL) for i, m in enumerate(mix)])
        assert len(ours) == len(mix)
    assert compiled.counters.compiles == compiles
    eager = Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS)
    calls = []
    eager.loop.components.transformer.register_forward_pre_hook(lambda _, args, kwargs: calls.append("lora_index" in kwargs),
                                                                with_kwargs=True, prepend=True)  # fmt: skip
    _latents(eager, _request(shape=SMALL))
    assert calls and not any(calls)  # a request without adapters: its steps take no rows
    _latents(eager, _request(shape=SMALL, loras={"a": 1.0}))
    assert any(calls)


def test_unloading_is_refused_while_a_request_uses_it_and_drops_exactly_its_cache_entries(files):
    engine = Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"], "b": files["b"]}, lora_slots=SLOTS)
    engine.submit(_request(loras={"a": 1.0}, shape=SMALL))
    with pytest.raises(AdapterError, match="in use by 1 request"):
        engine.unload_lora("a")
    while engine.has_work():
        engine.tick()
    _latents(engine, _request(loras={"b": 1.0}, shape=SMALL))
    entries = engine.projection_cache.stats.entries
    unloaded = engine.unload_lora("a")
    assert unloaded["slot"] == 0 and [a["name"] for a in engine.loras()] == ["b"]
    stats = engine.projection_cache.stats
    assert 0 < entries - stats.entries == stats.invalidations  # a's entries went, b's and the base's stayed
    hits = stats.hits
    _latents(engine, _request(loras={"b": 1.0}, shape=SMALL))
    assert engine.projection_cache.stats.hits > hits
    [gone] = engine.generate([_request(loras={"a": 1.0}, shape=SMALL)])
    assert gone.status == "rejected" and "unknown lora 'a'" in gone.error
    assert engine.load_lora("a", files["a"])["slot"] == 0  # the freed slot is reused


def test_a_saved_state_records_its_adapters_and_resumes_only_where_they_are(files, engine, tmp_path):
    state = engine.start(_request(loras={"a": 0.7}, shape=SMALL))
    for _ in range(2):
        engine.step(state)
    path = tmp_path / "state.pt"
    state.save(path)
    [uninterrupted] = _latents(engine, _request(loras={"a": 0.7}, shape=SMALL))
    other = Engine.from_card("tiny-wan", device="cpu", loras={"b": files["b"]}, lora_slots=SLOTS)
    with pytest.raises(ValueError, match="adapters: request .*lora 'a' is not loaded"):
        other.resume(type(state).load(path))
    assert torch.equal(engine.finish(engine.resume(type(state).load(path))).latents, uninterrupted)


def test_bad_adapters_and_choices_are_refused_naming_the_key_or_field(files, engine, tmp_path):
    from safetensors.torch import save_file

    def write(name, tensors):
        save_file(tensors, str(tmp_path / name))
        return tmp_path / name

    width = 32
    cases = {
        write("ghost.safetensors", {"transformer.blocks.7.attn1.to_q.lora_A.weight": torch.zeros(4, width),
                                    "transformer.blocks.7.attn1.to_q.lora_B.weight": torch.zeros(width, 4)}): "does not have",
        write("shape.safetensors", {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, width + 1),
                                    "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(width, 4)}): "do not fit",
        write("rank.safetensors", {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(16, width),
                                   "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(width, 16)}): "max_lora_rank=8",
        write("text.safetensors", {"text_encoder.encoder.lora_A.weight": torch.zeros(4, width),
                                   "text_encoder.encoder.lora_B.weight": torch.zeros(width, 4)}): "not the denoiser's",
    }  # fmt: skip
    for path, message in cases.items():
        with pytest.raises(AdapterError, match=message):
            engine.load_lora("bad", path)
    with pytest.raises(AdapterError, match="must be 1-64 characters"):
        engine.load_lora("no spaces", files["a"])
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_lora("a", files["a"])
    with pytest.raises(ValueError, match=r"loras\['a'\]=nan"):
        _request(loras={"a": float("nan")})
    for loras, message in (({"nope": 1.0}, "unknown lora 'nope'"), ({"a": 1.0, "b": 1.0, "c": 1.0}, "unknown lora 'c'")):
        [result] = engine.generate([_request(loras=loras, shape=SMALL)])
        assert result.status == "rejected" and message in result.error and "loras" in result.error
    full = Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"]}, lora_slots=LoraSlots(1, 8, 1))
    with pytest.raises(AdapterError, match="all max_loras=1 slots hold adapters"):
        full.load_lora("b", files["b"])
    [cached] = engine.generate([_request(loras={"a": 1.0}, shape=SMALL, cache="teacache")])
    assert cached.ok, cached.error  # step caching runs with adapters: tests/test_lora_caching.py
    [plain] = Engine.from_card("tiny-wan", device="cpu").generate([_request(loras={"a": 1.0}, shape=SMALL)])
    assert plain.status == "rejected" and "serves no LoRA adapters" in plain.error


def test_the_slot_shape_is_a_signature_factor_and_the_adapters_in_them_are_not(files):
    def signature(engine):  # nothing compiles: the text is given, so the first plan is a denoise step's
        return engine.compiler.signature(engine.loop.next(engine.start(_request(shape=SMALL))))

    aot = CompileConfig(backend="aot_eager")
    one = signature(Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=aot, loras={"a": files["a"]}, lora_slots=SLOTS))
    two = signature(Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=aot, loras={"b": files["b"]}, lora_slots=SLOTS))
    wider = signature(Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=aot, lora_slots=LoraSlots(4, 16, 2)))
    none = signature(Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=aot))
    assert one.key() == two.key() and one.adapters.startswith("lora-slots:4x8/2:")
    assert wider.diff(one) == [f"adapters: {wider.adapters} != {one.adapters}"]
    assert none.adapters == "none" and none.key() != one.key()


def test_target_modules_give_slots_to_the_named_linears_alone_and_refuse_an_adapter_beyond_them(files):
    """`LoraSlots(target_modules=...)`: peft's name matching picks the slotted linears; an adapter on
    those equals diffusers; one with factors elsewhere is refused naming the key, nothing loaded."""
    from fvgraph.cli.options import adapter_options

    attention = ["to_q", "to_k", "to_v", "to_out.0"]
    slots = LoraSlots(4, 8, 2, target_modules=attention)
    engine = Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"]}, lora_slots=slots)
    names = engine.adapters.store.names
    blocks = len(engine.loop.components.transformer.blocks)
    assert len(names) == blocks * 2 * len(attention)  # attn1 and attn2 of every block; no FFN, proj_out, embedder
    assert all(n.split(".")[2] in ("attn1", "attn2") and n.endswith(tuple(attention)) for n in names)
    every = Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS).adapters.store
    assert len(every.names) > len(names) and every.factor() != engine.adapters.store.factor()  # a signature fact

    [result] = engine.generate([_request(loras={"a": 0.7})])
    assert_matches_reference(result.latents, _reference(files, {"a": 0.7}))

    with pytest.raises(AdapterError, match=r"transformer\.blocks\.0\.ffn\.net\.0\.proj: not an adapted linear .*target_modules"):
        engine.load_lora("b", files["b"])  # musubi's file adapts the FFN linears too
    assert [entry["name"] for entry in engine.loras()] == ["a"]
    with pytest.raises(ValueError, match=r"target_modules=\['nope'\] names no linear"):
        Engine.from_card("tiny-wan", device="cpu", loras={"a": files["a"]}, lora_slots=LoraSlots(target_modules=["nope"]))
    assert adapter_options([], [], None, None, "to_q, to_v")["lora_slots"].target_modules == ("to_q", "to_v")
    with pytest.raises(ValueError, match="--lora-target-modules: target_modules=.* must be a non-empty list"):
        adapter_options([], [], None, None, "to_q,,to_v")
