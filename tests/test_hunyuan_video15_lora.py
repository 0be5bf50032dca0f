"""LoRA adapters on HunyuanVideo-1.5 (tiny-hunyuanvideo1.5), checked against diffusers on untouched weights.

diffusers 0.42.1 gives HunyuanVideo15Pipeline no LoRA loader mixin (no `load_lora_weights`), but its
transformer is a PeftAdapterMixin: the reference is HunyuanVideo15Pipeline built from its own copy of
the seeded weights, with `pipe.transformer.load_lora_adapter(file, adapter_name=..., prefix="transformer",
use_safetensors=True)` and `pipe.transformer.set_adapters(names, weights)`. The files are peft keys
under `transformer.` with their LoraConfig as metadata, as every diffusers pipeline's
`save_lora_weights` writes them (LoraBaseMixin's, here).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.slots import LoraSlots
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import load_components
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec

from lora_files import ATTENTION, peft_lora
from reference_helpers import assert_matches_reference, assert_shares_no_storage

CARD = "tiny-hunyuanvideo1.5"
SLOTS = LoraSlots(max_loras=4, max_lora_rank=8, max_loras_per_request=2)
# Both streams of the blocks' joint attention, and the token refiner's attention (the text stream -O1 hoists).
JOINT = [*ATTENTION, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
SHAPE = dict(num_inference_steps=2, num_frames=5, height=32, width=48)
CFG = dict(prompt='a sign saying "hi" at night', negative_prompt="blurry", guidance_scale=4.0, **SHAPE)
NO_CFG = dict(prompt="a red fox running through snow", guidance_scale=1.0, **SHAPE)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hunyuan-loras")
    return {
        "a": peft_lora(d / "a", 1, JOINT, rank=4, alpha=8.0, card=CARD),  # scaling 2
        # the modulations, the feed-forwards, the text embedders and the ByT5 projection: scaling 0.5
        "b": peft_lora(d / "b", 2, ["norm1.linear", "norm1_context.linear", "net.0.proj", "proj_in", "linear_2"], rank=8,
                       alpha=4.0, card=CARD),  # fmt: skip
        "c": peft_lora(d / "c", 3, ["to_q", "ff_context.net.2"], rank=2, alpha=2.0, card=CARD),
        "wan": peft_lora(d / "wan", 4, ["attn2.to_k"], rank=4, alpha=4.0),
    }


@pytest.fixture(scope="module")
def engine(files):
    return Engine.from_card(CARD, device="cpu", loras={"a": files["a"], "b": files["b"]}, lora_slots=SLOTS)


def _reference(files, adapters: dict[str, float], seed: int, args: dict) -> torch.Tensor:
    """HunyuanVideo15Pipeline on its own copy of the seeded weights, `adapters` loaded into its transformer and set."""
    card = get_card(CARD)
    c = load_components(card, None, torch.device("cpu"))
    args = dict(args)
    pipe = HunyuanVideo15Pipeline(transformer=c.transformer, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                                  text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
                                  scheduler=FlowMatchEulerDiscreteScheduler(**card.recipe.sampler.config),
                                  guider=ClassifierFreeGuidance(guidance_scale=args.pop("guidance_scale")))  # fmt: skip
    for name in adapters:
        pipe.transformer.load_lora_adapter(str(files[name]), adapter_name=name, prefix="transformer", use_safetensors=True)
    if adapters:
        pipe.transformer.set_adapters(list(adapters), weights=list(adapters.values()))
    return pipe(generator=torch.Generator().manual_seed(seed), output_type="latent", **args).frames, pipe


def _latents(engine, *requests) -> list[torch.Tensor]:
    results = engine.generate(list(requests))
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.latents for r in results]


def test_adapters_at_their_scales_equal_the_transformers_load_lora_adapter_and_set_adapters(engine, files):
    mix = [(None, CFG), ({"a": 0.7}, CFG), ({"a": 0.7, "b": 0.5}, CFG), ({"b": 1.3}, NO_CFG)]
    results = engine.generate([Request(seed=7, output_type="latent", loras=loras, **args) for loras, args in mix])
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.provenance["loras"] for r in results] == [{}, {"a": 0.7}, {"a": 0.7, "b": 0.5}, {"b": 1.3}]
    references = []
    for (loras, args), result in zip(mix, results):
        reference, pipe = _reference(files, loras or {}, 7, args)
        assert_shares_no_storage(engine, pipe)
        assert_matches_reference(result.latents, reference)
        references.append(reference)
    base = results[0].latents
    assert (results[1].latents - base).abs().max() > 0.05  # the adapter moves the result far beyond the tolerance
    assert (results[2].latents - results[1].latents).abs().max() > 0.05  # so does the second one beside it
    [no_cfg_base] = _latents(engine, Request(seed=7, output_type="latent", **NO_CFG))
    assert (results[3].latents - no_cfg_base).abs().max() > 0.05


def test_a_mixed_batch_equals_each_request_alone_bit_for_bit(engine):
    mix = [({"a": 0.7}, CFG), (None, CFG), ({"a": 0.4, "b": 0.9}, CFG), ({"b": 0.5}, NO_CFG), (None, NO_CFG)]
    requests = lambda: [Request(seed=3 + i, output_type="latent", loras=m, **args) for i, (m, args) in enumerate(mix)]  # noqa: E731
    together = _latents(engine, *requests())
    for request, ours in zip(requests(), together):
        [alone] = _latents(engine, request)
        assert torch.equal(ours, alone), request.loras


def test_compiled_mixed_adapters_equal_eager_and_loading_and_unloading_compile_nothing(files):
    """-O1 (aot_eager): CFG fused with the rows, the text stream hoisted through the adapted token
    refiner; four adapter choices in one bucket-4 batch; an adapter loaded while serving (into a free
    slot) and one unloaded, with no compile."""
    mix = [{"a": 0.7}, {"b": 0.5}, {"a": 0.7, "b": 0.5}, None]
    requests = lambda: [Request(seed=7 + i, output_type="latent", loras=m, **CFG) for i, m in enumerate(mix)]  # noqa: E731
    loras = {"a": files["a"], "b": files["b"]}
    eager = Engine.from_card(CARD, device="cpu", loras=loras, lora_slots=SLOTS)
    alone = [_latents(eager, r)[0] for r in requests()]
    assert len({tuple(x.flatten()[:8].tolist()) for x in alone}) == 4
    compiled = Engine.from_card(CARD, device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"), loras=loras,
                                lora_slots=SLOTS, buckets=BucketSpec(batch_sizes=(4,)))  # fmt: skip
    compiled.warmup(requests())  # then fail_on_recompile
    compiles = compiled.counters.compiles
    tolerance = compiled.card.parity.tolerance("fp32")
    for ours, reference in zip(_latents(compiled, *requests()), alone):
        torch.testing.assert_close(ours, reference, atol=tolerance.atol, rtol=tolerance.rtol)
    compiled.load_lora("c", files["c"])
    compiled.unload_lora("b")
    with_c = [Request(seed=1, output_type="latent", loras={"c": 0.8}, **CFG), *requests()[:1], requests()[3]]
    eager.load_lora("c", files["c"])
    for ours, reference in zip(_latents(compiled, *with_c), [_latents(eager, r)[0] for r in with_c]):
        torch.testing.assert_close(ours, reference, atol=tolerance.atol, rtol=tolerance.rtol)
    assert compiled.counters.compiles == compiles
    [refused] = compiled.generate([requests()[1]])
    assert not refused.ok and "loras" in refused.error and "'b'" in refused.error


def test_an_adapter_for_another_family_is_refused_naming_a_key(files):
    with pytest.raises(AdapterError, match=r"lora key transformer\.blocks\.0\.attn2\.to_k\.lora_A\.weight names module"):
        Engine.from_card(CARD, device="cpu", loras={"wan": files["wan"]}, lora_slots=SLOTS)


def test_image_to_video_takes_adapters_as_the_i2v_pipelines_transformer_does(files):
    """tiny-hunyuanvideo1.5-i2v (the same transformer sizes, SigLIP's tokens and the image's latents
    beside) with adapter "a" at 0.7 to HunyuanVideo15ImageToVideoPipeline after load_lora_adapter + set_adapters."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from PIL import Image

    card = get_card("tiny-hunyuanvideo1.5-i2v")
    image = Image.fromarray(torch.randint(0, 256, (40, 70, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8).numpy())
    c = load_components(card, None, torch.device("cpu"))
    pipe = HunyuanVideo15ImageToVideoPipeline(
        transformer=c.transformer, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
        tokenizer_2=c.tokenizer_2, scheduler=FlowMatchEulerDiscreteScheduler(**card.recipe.sampler.config),
        guider=ClassifierFreeGuidance(guidance_scale=4.0), image_encoder=c.image_encoder, feature_extractor=c.image_processor,
    )  # fmt: skip
    pipe.transformer.load_lora_adapter(str(files["a"]), adapter_name="a", prefix="transformer", use_safetensors=True)
    pipe.transformer.set_adapters(["a"], weights=[0.7])
    args = dict(prompt=CFG["prompt"], negative_prompt=CFG["negative_prompt"], num_inference_steps=2, num_frames=5)
    expected = pipe(image=image, generator=torch.Generator().manual_seed(4), output_type="latent", **args).frames
    args["guidance_scale"] = 4.0  # the size: the image's bucket in both
    engine = Engine.from_card("tiny-hunyuanvideo1.5-i2v", device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS)
    assert_shares_no_storage(engine, pipe)
    [adapted, plain] = _latents(engine, Request(image=image, seed=4, output_type="latent", loras={"a": 0.7}, **args),
                                Request(image=image, seed=4, output_type="latent", **args))  # fmt: skip
    assert_matches_reference(adapted, expected)
    assert (adapted - plain).abs().max() > 1e-3  # the adapter moved the result, so the match above can fail
