"""LoRA adapters on the image loops (FLUX, Qwen-Image), checked against diffusers' own LoRA loading
on untouched weights: each family's pipeline with `load_lora_weights` + `set_adapters`, built from
its own copy of the seeded weights. The files are written by diffusers and peft (the pipeline's
`save_lora_weights`, LoraConfig as metadata), in peft keys with kohya-style `.alpha` keys (no
metadata), which diffusers' FLUX loader reads as network alphas, and in kohya sd-scripts' and XLabs'
FLUX layouts (fused q/k/v), which it converts.
"""

import inspect

import pytest
import torch
from diffusers import FluxPipeline, QwenImagePipeline

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.slots import LoraSlots
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from safetensors.torch import save_file

from lora_files import ATTENTION, alpha_keyed_lora, fresh_transformer, kohya_flux_lora, peft_lora, xlabs_flux_lora
from reference_helpers import assert_matches_reference

SLOTS = LoraSlots(max_loras=4, max_lora_rank=8, max_loras_per_request=2)
JOINT = [*ATTENTION, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]  # both streams of the joint attention
FLUX = dict(prompt="a red fox in snow", max_sequence_length=32, guidance_scale=3.5, num_inference_steps=3, height=64, width=64)
FLUX_TRUE_CFG = dict(prompt="a red fox in snow", negative_prompt="blurry", max_sequence_length=32, true_cfg_scale=3.0, guidance_scale=2.0,
                     num_inference_steps=3, height=32, width=48)  # fmt: skip
QWEN = dict(prompt="a lighthouse at dusk", negative_prompt="fog", true_cfg_scale=2.5, num_inference_steps=3, height=32, width=64)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("image-loras")
    return {
        "a": peft_lora(d / "a", 1, [*JOINT, "proj_mlp"], rank=4, alpha=8.0, card="tiny-flux"),  # scaling 2
        # the text and image embedders too: the text stream is what -O1 hoists
        "b": alpha_keyed_lora(d / "b.safetensors", 2, ["context_embedder", "x_embedder", "to_q", "proj_out"], rank=4, alpha=2.0),
        "qwen": peft_lora(d / "qwen", 3, [*JOINT, "txt_in", "img_mod.1"], rank=4, alpha=4.0, card="tiny-qwen-image"),
        "kohya": kohya_flux_lora(d / "kohya.safetensors", 5, fresh_transformer("tiny-flux")),
        "xlabs": xlabs_flux_lora(d / "xlabs.safetensors", 6, fresh_transformer("tiny-flux")),
        "wan": peft_lora(d / "wan", 4, ["attn2.to_k"], rank=4, alpha=4.0),
    }


def _reference_pipeline(pipeline_class, card_id: str, files, adapters: dict[str, float]):
    """diffusers' `pipeline_class` on its own copy of the card's seeded weights, `adapters` loaded and set."""
    card = get_card(card_id)
    c = load_components(card, None, torch.device("cpu"))
    accepted = inspect.signature(pipeline_class.__init__).parameters
    pipe = pipeline_class(**{k: m for k, m in c.modules().items() if k in accepted}, scheduler=diffusers_scheduler(card.recipe.sampler))
    for name in adapters:
        pipe.load_lora_weights(str(files[name]), adapter_name=name)
    if adapters:
        pipe.set_adapters(list(adapters), list(adapters.values()))
    return pipe


def _flux_reference(files, adapters: dict[str, float], seed: int, args: dict) -> torch.Tensor:
    pipe = _reference_pipeline(FluxPipeline, "tiny-flux", files, adapters)
    packed = pipe(generator=torch.Generator().manual_seed(seed), output_type="latent", **args).images
    return FluxPipeline._unpack_latents(packed, args["height"], args["width"], pipe.vae_scale_factor).unsqueeze(2)


def _latents(engine, *requests):
    results = engine.generate(list(requests))
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.latents for r in results]


def test_flux_adapters_at_their_scales_equal_flux_pipeline_load_lora_weights_and_set_adapters(files):
    engine = Engine.from_card("tiny-flux", device="cpu", loras={name: files[name] for name in ("a", "b", "kohya", "xlabs")},
                              lora_slots=SLOTS)  # fmt: skip
    mix = [(None, FLUX), ({"a": 0.7}, FLUX), ({"a": 0.7, "b": 0.5}, FLUX), ({"b": 1.0}, FLUX_TRUE_CFG), ({"kohya": 0.9}, FLUX),
           ({"xlabs": 0.8}, FLUX)]  # fmt: skip
    results = engine.generate([Request(seed=7, output_type="latent", loras=loras, **args) for loras, args in mix])
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.provenance["loras"] for r in results] == [{}, {"a": 0.7}, {"a": 0.7, "b": 0.5}, {"b": 1.0}, {"kohya": 0.9}, {"xlabs": 0.8}]
    base = results[0].latents
    assert_matches_reference(base, _flux_reference(files, {}, 7, FLUX))
    for (loras, args), result in zip(mix[1:], results[1:]):
        reference = _flux_reference(files, loras, 7, args)
        assert_matches_reference(result.latents, reference)
    assert (results[1].latents - base).abs().max() > 0.1  # the adapter moves the result far beyond the tolerance
    assert (results[2].latents - results[1].latents).abs().max() > 0.1  # so does the alpha-keyed one beside it
    assert (results[4].latents - base).abs().max() > 0.1  # and the kohya one
    assert (results[5].latents - base).abs().max() > 0.1  # and the XLabs one


def test_a_compiled_flux_batch_of_mixed_adapters_equals_each_request_alone_and_compiles_nothing_new(files):
    """-O1 (aot_eager): the branches fused with their rows, the text stream hoisted through the
    adapted context_embedder, four requests of four adapter choices in one bucket-4 batch."""
    mix = [{"a": 0.7}, {"b": 0.5}, {"a": 0.7, "b": 0.5}, None]
    requests = lambda: [Request(seed=7 + i, output_type="latent", loras=m, **FLUX) for i, m in enumerate(mix)]  # noqa: E731
    loras = {"a": files["a"], "b": files["b"]}
    eager = Engine.from_card("tiny-flux", device="cpu", loras=loras, lora_slots=SLOTS)
    alone = [_latents(eager, r)[0] for r in requests()]
    assert len({tuple(x.flatten()[:8].tolist()) for x in alone}) == 4
    compiled = Engine.from_card("tiny-flux", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                loras=loras, lora_slots=SLOTS, buckets=BucketSpec(batch_sizes=(4,)))  # fmt: skip
    compiled.warmup(requests())  # then fail_on_recompile
    compiles = compiled.counters.compiles
    tolerance = compiled.card.parity.tolerance("fp32")
    for ours, reference in zip(_latents(compiled, *requests()), alone):
        torch.testing.assert_close(ours, reference, atol=tolerance.atol, rtol=tolerance.rtol)
    reordered = [requests()[i] for i in (3, 2, 1, 0)]  # other adapters in each row: still the one graph
    for ours, reference in zip(_latents(compiled, *reordered), alone[::-1]):
        torch.testing.assert_close(ours, reference, atol=tolerance.atol, rtol=tolerance.rtol)
    assert compiled.counters.compiles == compiles and compiled.counters.batches >= 2 * 3


def test_a_qwen_image_adapter_equals_qwen_image_pipeline(files):
    engine = Engine.from_card("tiny-qwen-image", device="cpu", loras={"qwen": files["qwen"]}, lora_slots=SLOTS)
    base, adapted = _latents(engine, Request(seed=5, output_type="latent", **QWEN),
                             Request(seed=5, output_type="latent", loras={"qwen": 0.8}, **QWEN))  # fmt: skip
    pipe = _reference_pipeline(QwenImagePipeline, "tiny-qwen-image", files, {"qwen": 0.8})
    packed = pipe(generator=torch.Generator().manual_seed(5), output_type="latent", **QWEN).images
    reference = QwenImagePipeline._unpack_latents(packed, QWEN["height"], QWEN["width"], pipe.vae_scale_factor)
    assert_matches_reference(adapted, reference)
    assert (adapted - base).abs().max() > 0.1


def test_an_image_loop_refuses_another_familys_adapter_an_unconvertible_file_and_a_cached_request_with_one(files, tmp_path):
    with pytest.raises(AdapterError, match=r"lora key transformer\.blocks\.0\.attn2\.to_k.*does not have"):
        Engine.from_card("tiny-flux", device="cpu", loras={"wan": files["wan"]}, lora_slots=SLOTS)
    # kohya's fused single-block linear1 at a width other than FLUX.1's: diffusers' converter asserts, bare
    fused = {"lora_unet_single_blocks_0_linear1.lora_down.weight": torch.zeros(4, 32),
             "lora_unet_single_blocks_0_linear1.lora_up.weight": torch.zeros(224, 4)}  # fmt: skip
    save_file(fused, str(tmp_path / "fused.safetensors"))
    with pytest.raises(AdapterError, match=r"FluxPipeline\.lora_state_dict cannot read it: AssertionError"):
        Engine.from_card("tiny-flux", device="cpu", loras={"fused": tmp_path / "fused.safetensors"}, lora_slots=SLOTS)
    engine = Engine.from_card("tiny-flux", device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS)
    [result] = engine.generate([Request(loras={"a": 1.0}, cache={"method": "fbcache", "threshold": 0.1}, **FLUX)])
    assert result.ok, result.error  # step caching runs with adapters (tests/test_lora_caching.py holds Wan's to diffusers)


def test_a_saved_flux_state_keeps_its_adapters_and_resumes_only_where_they_are(files, tmp_path):
    engine = Engine.from_card("tiny-flux", device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS)
    request = lambda: Request(seed=3, output_type="latent", loras={"a": 0.7}, **FLUX)  # noqa: E731
    state = engine.start(request())
    for _ in range(2):  # its text encode and its first denoise step
        engine.step(state)
    state.save(tmp_path / "state.pt")
    [uninterrupted] = _latents(engine, request())
    other = Engine.from_card("tiny-flux", device="cpu", loras={"b": files["b"]}, lora_slots=SLOTS)
    with pytest.raises(ValueError, match="adapters: request .*lora 'a' is not loaded"):
        other.resume(type(state).load(tmp_path / "state.pt"))
    assert torch.equal(engine.finish(engine.resume(type(state).load(tmp_path / "state.pt"))).latents, uninterrupted)


def test_a_flux_file_on_a_wan_card_is_refused_naming_its_first_key_and_nothing_is_loaded(files):
    engine = Engine.from_card("tiny-wan", device="cpu", loras={"wan": files["wan"]}, lora_slots=SLOTS)
    refusals = {"kohya": r"WanPipeline\.lora_state_dict cannot read it: .*the file's first key is 'lora_unet_double_blocks_0",
                "xlabs": r"lora key 'double_blocks\.0\.processor\..*is not the denoiser's.*another model family"}  # fmt: skip
    for name, refusal in refusals.items():
        with pytest.raises(AdapterError, match=refusal):
            engine.load_lora(name, files[name])
    assert [a["name"] for a in engine.loras()] == ["wan"]
