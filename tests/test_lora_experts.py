"""Per-expert LoRA adapters on a two-expert card (Wan 2.2 A14B), checked against diffusers' own loader.

One LoRA file per expert, written by diffusers and peft (`WanPipeline.save_lora_weights` of a random
peft adapter, its LoraConfig as metadata). diffusers' side loads the high-noise one with
`load_lora_weights(f, adapter_name=...)`, the low-noise one with `load_into_transformer_2=True`, and
sets both with `set_adapters`, on a WanPipeline built from its own copy of the seeded weights.
fvgraph loads the same files into each expert's slots, at build (LoraFile) or while serving
(`load_lora(..., expert="transformer_2")`).
"""

import pytest
import torch
from diffusers import WanPipeline

import fvgraph
from conftest import embeds
from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.setup import LoraFile
from fvgraph.adapters.slots import LoraSlots, slot_store
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.runtime.buckets import BucketSpec
from lora_files import ATTENTION, peft_lora
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

CARD = "tiny-wan2.2-a14b"
SHAPE = {"height": 48, "width": 64, "num_frames": 5, "num_inference_steps": 6}  # 6 steps: 2 high-noise, 4 low-noise
SLOTS = LoraSlots(max_loras=3, max_lora_rank=8, max_loras_per_request=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("expert-loras")
    return {
        "hi": peft_lora(d / "hi", 1, ATTENTION, rank=4, alpha=8.0, card=CARD),  # for transformer
        "lo": peft_lora(d / "lo", 2, ["attn1.to_q", "attn2.to_v", "ffn.net.0.proj"], rank=4, alpha=4.0, card=CARD),
        "lo2": peft_lora(d / "lo2", 3, ["attn1.to_k", "attn1.to_out.0"], rank=2, alpha=2.0, card=CARD),
        "i2v": peft_lora(d / "i2v", 4, ["attn2.add_k_proj"], card="tiny-wan-i2v"),  # keys a t2v expert lacks
    }


@pytest.fixture(scope="module")
def engine(files):
    return Engine.from_card(CARD, device="cpu", lora_slots=SLOTS,
                            loras={"hi": files["hi"], "lo": LoraFile(files["lo"], expert="transformer_2")})  # fmt: skip


def _request(seed=7, loras=None, **extra):
    positive, negative = embeds(11, get_card(CARD))
    return fvgraph.Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=4.0, guidance_scale_2=3.0,
                           seed=seed, output_type="latent", loras=loras, **{**SHAPE, **extra})  # fmt: skip


def _latents(engine, *requests):
    results = engine.generate(list(requests))
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.latents for r in results]


def _reference(files, high: dict[str, float], low: dict[str, float]):
    """diffusers' WanPipeline with both experts on its own copy of the weights, `high` loaded into
    transformer and `low` into transformer_2, all set at their scales."""
    card = get_card(CARD)
    c = load_components(card, None, torch.device("cpu"))
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       transformer_2=c.transformer_2, scheduler=diffusers_scheduler(card.recipe.sampler),
                       boundary_ratio=card.recipe.boundary_ratio)  # fmt: skip
    for name in high:
        pipe.load_lora_weights(str(files[name]), adapter_name=name)
    for name in low:
        pipe.load_lora_weights(str(files[name]), adapter_name=name, load_into_transformer_2=True)
    scales = {**high, **low}
    if scales:
        pipe.set_adapters(list(scales), list(scales.values()))
    positive, negative = embeds(11, card)
    return pipe(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=4.0, guidance_scale_2=3.0,
                generator=torch.Generator().manual_seed(7), output_type="latent", **SHAPE).frames  # fmt: skip


def test_each_expert_runs_its_own_adapter_as_diffusers_load_into_transformer_2(engine, files):
    kinds = []
    results = engine.generate([_request(loras={"hi": 0.7, "lo": 0.5}), _request(loras={"lo": 0.5}), _request(loras={"hi": 0.7})],
                              on_step=lambda state, kind: kinds.append(kind))  # fmt: skip
    assert all(r.ok for r in results), [r.error for r in results]
    assert {"denoise_cfg", "denoise_cfg_2"} <= set(kinds)  # both experts ran
    both, low, high = (r.latents for r in results)
    assert [a["expert"] for a in engine.loras()] == ["transformer", "transformer_2"]
    base = _reference(files, {}, {})
    for ours, (hi, lo) in ((both, ({"hi": 0.7}, {"lo": 0.5})), (low, ({}, {"lo": 0.5})), (high, ({"hi": 0.7}, {}))):
        reference = _reference(files, hi, lo)
        assert_matches_reference(ours, reference)
        assert (reference - base).abs().max() > 0.05  # each expert's adapter moves the result far past the tolerance
    assert (both - low).abs().max() > 0.05 and (both - high).abs().max() > 0.05


def test_loaded_while_serving_into_the_named_expert_equals_loaded_at_build(engine, files):
    served = Engine.from_card(CARD, device="cpu", lora_slots=SLOTS)
    assert served.load_lora("lo", files["lo"], expert="transformer_2")["expert"] == "transformer_2"
    assert served.load_lora("hi", files["hi"])["expert"] == "transformer"  # no expert: the high-noise one, as diffusers
    request = _request(loras={"hi": 0.7, "lo": 0.5}, num_inference_steps=3)
    assert torch.equal(_latents(served, request)[0], _latents(engine, request)[0])


def test_compiled_equals_eager_and_loading_into_either_expert_compiles_nothing(engine, files):
    compiled = Engine.from_card(CARD, device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                lora_slots=SLOTS, loras={"hi": files["hi"], "lo": LoraFile(files["lo"], expert="transformer_2")},
                                buckets=BucketSpec(batch_sizes=(1, 2)))  # fmt: skip
    requests = lambda: [_request(seed=3, loras={"hi": 0.7, "lo": 0.5}, num_inference_steps=3),  # noqa: E731
                        _request(seed=4, num_inference_steps=3)]  # fmt: skip
    compiled.warmup(requests())
    for ours, eager in zip(_latents(compiled, *requests()), _latents(engine, *requests())):
        assert_within_compiled_noise(ours, eager)
    compiles = compiled.counters.compiles
    compiled.load_lora("lo2", files["lo2"], expert="transformer_2")
    compiled.unload_lora("lo")
    [ours] = _latents(compiled, _request(seed=5, loras={"hi": 0.7, "lo2": 1.0}, num_inference_steps=3))
    assert compiled.counters.compiles == compiles
    engine.load_lora("lo2", files["lo2"], expert="transformer_2")
    try:
        [eager] = _latents(engine, _request(seed=5, loras={"hi": 0.7, "lo2": 1.0}, num_inference_steps=3))
    finally:
        engine.unload_lora("lo2")
    assert_within_compiled_noise(ours, eager)


def test_requests_with_different_expert_adapters_interleaved_equal_each_alone(engine):
    mix = [{"hi": 0.7, "lo": 0.5}, None, {"lo": 1.0}, {"hi": 0.3}]
    requests = lambda: [_request(seed=20 + i, loras=m, num_inference_steps=4 + i % 2) for i, m in enumerate(mix)]  # noqa: E731
    alone = [_latents(engine, r)[0] for r in requests()]
    together = _latents(engine, *requests())
    assert all(torch.equal(a, b) for a, b in zip(alone, together))  # -O0: bit for bit
    assert len({tuple(x.flatten()[:8].tolist()) for x in alone}) == len(mix)


def _slots_empty(engine) -> bool:
    components = engine.loop.components
    stores = [slot_store(components.transformer), slot_store(components.transformer_2)]
    return all(digest is None for store in stores for digest in store.digests)


def test_bad_expert_and_keys_that_do_not_fit_are_refused_loading_nothing(files):
    served = Engine.from_card(CARD, device="cpu", lora_slots=SLOTS)
    with pytest.raises(AdapterError, match=r"expert='transformer_3' must be 'transformer' .* or 'transformer_2'"):
        served.load_lora("x", files["lo"], expert="transformer_3")
    with pytest.raises(AdapterError, match=r"expert 'transformer_2': lora key transformer\.blocks\.0\.attn2\.add_k_proj"):
        served.load_lora("x", files["i2v"], expert="transformer_2")
    assert served.loras() == [] and _slots_empty(served)
    with pytest.raises(AdapterError, match=r"expert='transformer_3' must be"):
        Engine.from_card(CARD, device="cpu", lora_slots=SLOTS, loras={"lo": LoraFile(files["lo"], expert="transformer_3")})
    one = Engine.from_card("tiny-wan", device="cpu", lora_slots=SLOTS)
    for expert in ("transformer", "transformer_2"):
        with pytest.raises(AdapterError, match=rf"expert='{expert}': this card has one denoiser; leave expert unset"):
            one.load_lora("x", peft_lora(files["hi"].parent.parent / "one", 5, ATTENTION), expert=expert)
    assert one.loras() == []


def test_a_request_combines_at_most_max_loras_per_request_on_each_expert(files):
    slots = LoraSlots(max_loras=3, max_lora_rank=8, max_loras_per_request=1)
    engine = Engine.from_card(CARD, device="cpu", lora_slots=slots,
                              loras={"hi": files["hi"], "lo": LoraFile(files["lo"], expert="transformer_2"),
                                     "lo2": LoraFile(files["lo2"], expert="transformer_2")})  # fmt: skip
    [ok, refused] = engine.generate([_request(loras={"hi": 1.0, "lo": 1.0}, num_inference_steps=2),
                                     _request(loras={"lo": 1.0, "lo2": 1.0}, num_inference_steps=2)])  # fmt: skip
    assert ok.ok, ok.error
    assert refused.status == "rejected" and "2 loras for transformer_2 in one request" in refused.error


def test_cli_lora_takes_an_expert_suffix(files, tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    from fvgraph.cli import app
    from fvgraph.cli.options import adapter_options

    loras = adapter_options([f"lo={files['lo']}@transformer_2", f"hi={files['hi']}@transformer", "v=a@b.safetensors"], [], None, None)["loras"]
    assert loras == {"lo": LoraFile(files["lo"], "transformer_2"), "hi": LoraFile(files["hi"], "transformer"), "v": Path("a@b.safetensors")}
    with pytest.raises(ValueError, match=r"--lora lo=.*the suffix @transformer_3 must be @transformer .* or @transformer_2"):
        adapter_options([f"lo={files['lo']}@transformer_3"], [], None, None)
    runner = CliRunner()
    common = ["generate", "--card", CARD, "-O0", "--frames", "5", "--height", "32", "--width", "32", "--steps", "3", "--seed", "1"]
    plain = runner.invoke(app, [*common, "-o", str(tmp_path / "plain.gif")])
    adapted = runner.invoke(app, [*common, "--lora", f"lo={files['lo']}@transformer_2", "-o", str(tmp_path / "lo.gif")])
    assert plain.exit_code == 0 and adapted.exit_code == 0, adapted.output
    assert (tmp_path / "plain.gif").read_bytes() != (tmp_path / "lo.gif").read_bytes()
    bad = runner.invoke(app, [*common, "--lora", f"lo={files['lo']}@low", "-o", str(tmp_path / "bad.gif")])
    assert bad.exit_code == 2 and "the suffix @low must be @transformer" in bad.output
