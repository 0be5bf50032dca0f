"""Step caching on HunyuanVideo-1.5 through its denoiser sections (fvgraph/models/hunyuan_video15_sections.py):
FBCache, TaylorSeer and MagCache on tiny-hunyuanvideo1.5 equal diffusers' own hooks on
HunyuanVideo15Pipeline with the same weights (latents, and which denoiser calls ran their blocks),
FBCache and MagCache on tiny-hunyuanvideo1.5-i2v the hooks on HunyuanVideo15ImageToVideoPipeline;
the sections equal the plain step bit for bit; a cached request with a LoRA adapter equals the hook
with the adapter loaded into the transformer; cached and uncached requests together equal each
alone; the compiled caching steps equal eager.

The reference: diffusers 0.42.1's FBCache and MagCache hooks find the blocks through its
TransformerBlockRegistry, where `HunyuanVideo15TransformerBlock` is not registered (enable_cache
raises "not registered"). The test registers it as diffusers registers HunyuanVideo's dual-stream
block (`hooks/_helpers.py`: the block returns hidden_states first, encoder_hidden_states second),
which is a fact of the block's forward, and then runs diffusers' hooks unchanged. TaylorSeer's lite
mode needs no registration. The pipeline runs each guider branch in its own cache context, so the
branches keep their own cache state, as here.
"""

from __future__ import annotations

import pytest
import torch
import numpy as np
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock
from PIL import Image

from fvgraph.adapters.slots import LoraSlots
from fvgraph.caching.fb_cache_steps import AFTER_FIRST_KINDS
from fvgraph.caching.mag_cache import MagCache
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import load_components
from fvgraph.request import Request
from cache_helpers import run_together_and_alone
from lora_files import ATTENTION, peft_lora
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

CARD, I2V_CARD = "tiny-hunyuanvideo1.5", "tiny-hunyuanvideo1.5-i2v"
# A 40 x 70 image: its bucket on the i2v card is SHAPE's 32 x 48, where the pipeline runs without a size.
IMAGE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 70, 3), dtype=np.uint8))
STEPS = 6
SHAPE = dict(num_inference_steps=STEPS, num_frames=5, height=32, width=48)
CFG = dict(prompt='a sign saying "hi" at night', negative_prompt="blurry", guidance_scale=4.0)
NO_CFG = dict(prompt="a red fox running through snow", guidance_scale=1.0)
# On tiny-hunyuanvideo1.5 (seed 5, CFG) diffusers' FBCache runs the later blocks in 6 of 12 calls at
# 0.2 and in 4 of 12 at 0.3.
FB_THRESHOLDS = (0.2, 0.3)
TAYLOR = {
    "first_order": {"cache_interval": 2, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32"},
    "second_order_cooldown": {"cache_interval": 3, "disable_cache_before_step": 2, "disable_cache_after_step": 5,
                              "max_order": 2, "taylor_factors_dtype": "float32"},  # fmt: skip
}
MAG = {"max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card(CARD, device="cpu")


@pytest.fixture(scope="module", autouse=True)
def registered_block():
    """HunyuanVideo15TransformerBlock in diffusers' block registry, as diffusers registers HunyuanVideo's
    dual-stream block; removed afterwards."""
    registry = TransformerBlockRegistry._registry
    assert HunyuanVideo15TransformerBlock not in registry  # diffusers 0.42.1: the hooks cannot find the blocks
    TransformerBlockRegistry.register(model_class=HunyuanVideo15TransformerBlock,
                                      metadata=TransformerBlockMetadata(return_hidden_states_index=0,
                                                                        return_encoder_hidden_states_index=1))  # fmt: skip
    yield
    registry.pop(HunyuanVideo15TransformerBlock, None)


def _block_calls(transformer) -> tuple[list[bool], list]:
    """Per denoiser call, in order: whether its last block's attention ran (a cache hook replaces a
    skipped block's forward, so the block's own call still happens)."""
    calls: list[bool] = []
    handles = [transformer.x_embedder.register_forward_pre_hook(lambda m, a: calls.append(False)),
               transformer.transformer_blocks[-1].attn.register_forward_pre_hook(lambda m, a: calls.__setitem__(-1, True))]  # fmt: skip
    return calls, handles


def _reference(config, text: dict, lora: tuple[str, float] | None = None) -> tuple[torch.Tensor, list[bool]]:
    """HunyuanVideo15Pipeline (HunyuanVideo15ImageToVideoPipeline when `text` has an image) on a fresh
    copy of the seeded weights with diffusers' hook `config` (and a LoRA file at a scale loaded into
    its transformer, when given)."""
    text = dict(text)
    image = "image" in text
    card = get_card(I2V_CARD if image else CARD)
    c = load_components(card, None, torch.device("cpu"))
    common = dict(transformer=c.transformer, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                  text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
                  scheduler=FlowMatchEulerDiscreteScheduler(**card.recipe.sampler.config),
                  guider=ClassifierFreeGuidance(guidance_scale=text.pop("guidance_scale")))  # fmt: skip
    if image:
        pipe = HunyuanVideo15ImageToVideoPipeline(**common, image_encoder=c.image_encoder, feature_extractor=c.image_processor)
    else:
        pipe = HunyuanVideo15Pipeline(**common)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.transformer.load_lora_adapter(str(lora[0]), adapter_name="x", prefix="transformer", use_safetensors=True)
        pipe.transformer.set_adapters(["x"], weights=[lora[1]])
    pipe.transformer.enable_cache(config)
    calls, handles = _block_calls(pipe.transformer)
    try:
        shape = {k: v for k, v in SHAPE.items() if not image or k not in ("height", "width")}  # i2v: the image's bucket
        latents = pipe(generator=torch.Generator().manual_seed(5), output_type="latent", **text, **shape).frames
    finally:
        for handle in handles:
            handle.remove()
    return latents, calls


def _ours(engine, cache: dict, text: dict):
    """The result, and per denoiser call whether its blocks ran: FBCache's from each step's second
    launch's kind (one letter per branch), the other methods' from the blocks' own calls."""
    calls, handles = _block_calls(engine.loop.components.transformer)
    decided: list[bool] = []

    def record(state, plan, result):
        if plan.kind in AFTER_FIRST_KINDS.values():
            decided.extend(letter == "c" for letter in plan.kind.rsplit("_", 1)[1])

    try:
        [result] = engine.generate([Request(seed=5, output_type="latent", cache=cache, **text, **SHAPE)], on_result=record)
    finally:
        for handle in handles:
            handle.remove()
    assert result.ok, result.error
    return result, decided if cache["method"] == "fbcache" else calls


def test_fbcache_matches_diffusers_first_block_cache_at_two_thresholds(engine):
    counts = []
    for threshold in FB_THRESHOLDS:
        reference, theirs = _reference(FirstBlockCacheConfig(threshold=threshold), CFG)
        result, ours = _ours(engine, {"method": "fbcache", "threshold": threshold}, CFG)
        assert len(theirs) == 2 * STEPS
        assert ours == theirs  # the same denoiser calls ran their later blocks
        assert {k: result.cache[k] for k in ("computed", "reused")} == {"computed": sum(theirs), "reused": 2 * STEPS - sum(theirs)}
        assert_matches_reference(result.latents, reference)
        counts.append(sum(theirs))
    assert counts[0] > counts[1] >= 2  # the thresholds decide differently


@pytest.mark.parametrize("name", sorted(TAYLOR))
def test_taylorseer_matches_diffusers_taylorseer(engine, name):
    settings = TAYLOR[name]
    config = TaylorSeerCacheConfig(use_lite_mode=True, **{**settings, "taylor_factors_dtype": torch.float32})
    reference, theirs = _reference(config, CFG)
    result, ours = _ours(engine, {"method": "taylorseer", **settings}, CFG)
    assert len(theirs) == 2 * STEPS and 0 < sum(theirs) < 2 * STEPS
    assert ours == [True] * sum(theirs)  # a forecast step runs no transformer at all
    assert {k: result.cache[k] for k in ("computed", "reused")} == {"computed": sum(theirs), "reused": 2 * STEPS - sum(theirs)}
    assert_matches_reference(result.latents, reference)


@pytest.mark.parametrize("text", [CFG, NO_CFG], ids=["cfg", "no_cfg"])
def test_magcache_matches_diffusers_magcache(engine, text):
    reference, theirs = _reference(MagCacheConfig(threshold=0.06, num_inference_steps=STEPS, **MAG), text)
    cache = {"method": "magcache", "threshold": 0.06, **MAG}
    result, ours = _ours(engine, cache, text)
    expected = MagCache(Request(prompt="x", cache=cache).cache, STEPS).schedule(STEPS)
    assert not all(expected) and any(expected)
    branches = 2 if text["guidance_scale"] != 1 else 1
    assert ours == theirs == [step for step in expected for _ in range(branches)]  # the same calls ran their blocks
    assert_matches_reference(result.latents, reference)


@pytest.mark.parametrize("method", ["fbcache", "magcache"])
def test_an_image_to_video_request_caches_as_the_hooks_on_the_image_to_video_pipeline(method):
    """tiny-hunyuanvideo1.5-i2v: the sections take the image's latents and SigLIP tokens as the plain
    step does, so the cached request equals HunyuanVideo15ImageToVideoPipeline under diffusers' hook."""
    cache, config = {
        "fbcache": ({"method": "fbcache", "threshold": 0.2}, FirstBlockCacheConfig(threshold=0.2)),
        "magcache": ({"method": "magcache", "threshold": 0.06, **MAG}, MagCacheConfig(threshold=0.06, num_inference_steps=STEPS, **MAG)),
    }[method]  # fmt: skip
    text = {**CFG, "image": IMAGE}
    reference, theirs = _reference(config, text)
    result, ours = _ours(Engine.from_card(I2V_CARD, device="cpu"), cache, text)
    assert len(theirs) == 2 * STEPS and 0 < sum(theirs) < 2 * STEPS
    assert ours == theirs
    assert_matches_reference(result.latents, reference)


def test_a_cached_request_with_an_adapter_equals_the_hook_with_the_adapter(tmp_path):
    """The sections choose the rows' adapter slots around their calls: FBCache's first block and the
    blocks after it run the adapted linears, as peft's layers under diffusers' hook."""
    lora = peft_lora(tmp_path / "a", 1, [*ATTENTION, "add_q_proj", "to_add_out", "norm1.linear", "proj_in"], card=CARD)
    adapted = Engine.from_card(CARD, device="cpu", loras={"a": lora}, lora_slots=LoraSlots(max_loras=2, max_lora_rank=4))
    reference, theirs = _reference(FirstBlockCacheConfig(threshold=0.3), CFG, lora=(lora, 0.7))
    [result] = adapted.generate([Request(seed=5, output_type="latent", loras={"a": 0.7}, cache={"method": "fbcache", "threshold": 0.3},
                                         **CFG, **SHAPE)])  # fmt: skip
    assert result.ok, result.error
    assert result.cache["computed"] == sum(theirs) and 0 < sum(theirs) < 2 * STEPS
    assert_matches_reference(result.latents, reference)
    [plain] = adapted.generate([Request(seed=5, output_type="latent", cache={"method": "fbcache", "threshold": 0.3}, **CFG, **SHAPE)])
    assert (plain.latents - result.latents).abs().max() > 0.05  # the adapter moves the result far beyond the tolerance


def test_a_cache_that_never_reuses_equals_the_plain_step_bit_for_bit(engine):
    """The sections (embed, blocks, stream, project_out) run the traced forward line for line."""
    never = {"method": "magcache", "threshold": 0.06, **MAG, "max_skip_steps": 0}
    for text in (CFG, NO_CFG):
        cached, plain = engine.generate([Request(seed=3, output_type="latent", cache=cache, **text, **SHAPE) for cache in (never, None)])
        assert cached.ok and plain.ok and cached.cache["reused"] == 0
        assert torch.equal(cached.latents, plain.latents)


def test_cached_and_uncached_requests_together_equal_each_alone(engine):
    requests = [
        Request(seed=1, cache={"method": "fbcache", "threshold": 0.3}, **CFG, **SHAPE),
        Request(seed=2, **NO_CFG, **SHAPE),
        Request(seed=3, cache={"method": "taylorseer", **TAYLOR["first_order"]}, **CFG, **SHAPE),
        Request(seed=4, cache={"method": "fbcache", "threshold": 0.5}, **NO_CFG, num_inference_steps=4, num_frames=5, height=32, width=48),
        Request(seed=5, cache={"method": "magcache", "threshold": 0.06, **MAG}, **CFG, **SHAPE),
    ]  # fmt: skip
    run_together_and_alone(engine, [r.model_copy(update={"output_type": "latent"}) for r in requests])


def test_compiled_caching_steps_equal_eager(engine):
    compiled_engine = Engine.from_card(CARD, device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"))
    caches = [({"method": "fbcache", "threshold": 0.3}, CFG), ({"method": "taylorseer", **TAYLOR["first_order"]}, CFG),
              ({"method": "magcache", "threshold": 0.06, **MAG}, NO_CFG)]
    requests = [Request(seed=7 + i, output_type="latent", cache=cache, **text, **SHAPE) for i, (cache, text) in enumerate(caches)]
    compiled = compiled_engine.generate(requests)  # captured with fullgraph: a graph break fails here
    kinds = {s.step_kind for s in compiled_engine.compiler.signatures}
    assert kinds & set(AFTER_FIRST_KINDS.values()) and "denoise_cfg_taylor_predict" in kinds and "denoise_reuse" in kinds
    for ours, theirs in zip(compiled, engine.generate(requests)):
        assert ours.ok, ours.error
        assert ours.cache == theirs.cache
        assert_within_compiled_noise(ours.latents, theirs.latents)


def test_teacache_without_coefficients_is_refused_naming_the_field(engine):
    [refused] = engine.generate([Request(cache={"method": "teacache"}, **CFG, **SHAPE)])
    assert refused.status == "rejected" and "cache.coefficients" in refused.error, refused.error
