"""Step caching with LoRA adapters in slots: a cached request with an adapter equals diffusers with the
adapter loaded by `load_lora_weights` + `set_adapters` and the method's hook (`enable_cache`; TeaCache's
transcribed forward, as tests/test_tea_cache.py) on an untouched copy of the weights, with the same
denoiser calls computing their blocks; compiled equal to eager; and requests with and without
adapters, cached and not, together each equal to itself alone.

Each diffusers cache config is built here from the settings the request sends (the tolerances are
the reference ones of tests/reference_helpers.py, measured on these cards).
"""

import pytest
import torch
from diffusers import WanPipeline
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

import fvgraph
from cache_helpers import run_together_and_alone
from conftest import embeds
from fvgraph.adapters.slots import LoraSlots
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.runtime.buckets import BucketSpec
from lora_files import peft_lora
from reference_helpers import assert_matches_reference, assert_within_compiled_noise
from test_tea_cache import enable_reference_teacache

STEPS = 10
SHAPE = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": STEPS}
SLOTS = LoraSlots(max_loras=4, max_lora_rank=8, max_loras_per_request=2)
MAG = {"max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}  # tests/test_mag_cache.py's
TAYLOR = {"cache_interval": 3, "disable_cache_before_step": 2, "max_order": 1}  # tests/test_taylor_seer.py's first_order
# Per method: the request's `cache`, and the hook diffusers' side runs (on its pipeline's transformer).
CACHES = {
    "fbcache": ({"method": "fbcache", "threshold": 0.059},
                lambda t: t.enable_cache(FirstBlockCacheConfig(threshold=0.059))),
    "magcache": ({"method": "magcache", "threshold": 0.06, **MAG},
                 lambda t: t.enable_cache(MagCacheConfig(threshold=0.06, num_inference_steps=STEPS, **MAG))),
    "taylorseer": ({"method": "taylorseer", **TAYLOR, "taylor_factors_dtype": "float32"},
                   lambda t: t.enable_cache(TaylorSeerCacheConfig(use_lite_mode=True, taylor_factors_dtype=torch.float32, **TAYLOR))),
    "teacache": ({"method": "teacache", "threshold": 0.3, "coefficients": [0.25, 0.0]},
                 lambda t: enable_reference_teacache(t, STEPS, 0.3, False, [0.25, 0.0])),
}  # fmt: skip


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    # every attention projection and the FFN's: the first block's residual (FBCache's signal) moves with it
    return peft_lora(tmp_path_factory.mktemp("loras") / "a", 1, ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"],
                     rank=4, alpha=8.0)  # fmt: skip


@pytest.fixture(scope="module")
def engine(lora_file):
    return Engine.from_card("tiny-wan", device="cpu", loras={"a": lora_file}, lora_slots=SLOTS)


def _request(seed: int, cache: dict | None, loras: dict | None, guidance_scale: float = 5.0) -> fvgraph.Request:
    positive, negative = embeds(seed, get_card("tiny-wan"))
    return fvgraph.Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale, seed=seed,
                           output_type="latent", cache=cache, loras=loras, **SHAPE)  # fmt: skip


def _last_block_runs(transformer) -> tuple[list[bool], list]:
    """Per denoiser call, in order: whether its last block ran (every method computes it only with the rest)."""
    calls: list[bool] = []
    handles = [transformer.patch_embedding.register_forward_pre_hook(lambda m, a: calls.append(False)),
               transformer.blocks[-1].attn1.register_forward_pre_hook(lambda m, a: calls.__setitem__(-1, True))]  # fmt: skip
    return calls, handles


@pytest.mark.parametrize("method", sorted(CACHES))
def test_a_cached_request_with_an_adapter_equals_diffusers_lora_and_the_same_hook(engine, lora_file, method):
    cache, enable = CACHES[method]
    c = load_components(engine.card, None, torch.device("cpu"))  # the same weights, nothing of fvgraph in them
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(engine.card.recipe.sampler))  # fmt: skip
    pipe.load_lora_weights(str(lora_file), adapter_name="a")
    pipe.set_adapters(["a"], [0.7])
    enable(pipe.transformer)
    request = _request(21, cache, {"a": 0.7})
    theirs, handles = _last_block_runs(pipe.transformer)
    try:
        reference = pipe(prompt_embeds=request.prompt_embeds[None], negative_prompt_embeds=request.negative_prompt_embeds[None],
                         guidance_scale=5.0, generator=torch.Generator().manual_seed(21), output_type="latent", **SHAPE).frames  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    [result, without] = engine.generate([request, _request(21, cache, None)])
    assert result.ok and without.ok, (result.error, without.error)
    assert len(theirs) == 2 * STEPS and not all(theirs) and any(theirs)
    assert {k: result.cache[k] for k in ("method", "computed", "reused")} == {"method": method, "computed": sum(theirs),
                                                                              "reused": 2 * STEPS - sum(theirs)}  # fmt: skip
    assert_matches_reference(result.latents, reference)
    assert (result.latents - without.latents).abs().max() > 1e-2  # the adapter changed what the cached steps computed


def _mixed() -> list[fvgraph.Request]:
    """With and without the adapter, cached (each method) and not."""
    return [_request(1, CACHES["fbcache"][0], {"a": 0.7}), _request(2, None, None), _request(3, CACHES["magcache"][0], None),
            _request(4, None, {"a": 1.0}), _request(5, CACHES["taylorseer"][0], {"a": 0.5}),
            _request(6, CACHES["teacache"][0], {"a": 0.7}), _request(7, CACHES["fbcache"][0], None)]  # fmt: skip


def test_requests_with_and_without_adapters_cached_and_not_together_equal_each_alone(engine):
    run_together_and_alone(engine, _mixed())  # -O0: bit for bit


def test_compiled_cached_steps_with_adapters_equal_eager(engine, lora_file):
    compiled = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                loras={"a": lora_file}, lora_slots=SLOTS, buckets=BucketSpec(batch_sizes=(1, 2)))  # fmt: skip
    requests = [_request(1, CACHES["fbcache"][0], {"a": 0.7}), _request(3, CACHES["magcache"][0], {"a": 0.7}),
                _request(6, CACHES["teacache"][0], None)]  # fmt: skip
    for ours, alone in zip(compiled.generate(requests), engine.generate(requests)):
        assert ours.ok, ours.error
        assert_within_compiled_noise(ours.latents, alone.latents)
        assert ours.cache == alone.cache
