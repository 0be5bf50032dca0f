"""FLOPs a cached request avoided: the step graphs' FLOPs, counted once per signature on fake tensors,
equal an independent count on diffusers' own transformer run for real."""

import re

import torch

from fvgraph.contract.flops import flop_counter
from fvgraph.request import Request
from conftest import embeds

STEPS = 6
CACHE = {"method": "magcache", "threshold": 0.06, "max_skip_steps": 2, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}


def _forward_flops(transformer, latents_shape, text_shape) -> tuple[int, int, dict]:
    """(whole forward, its blocks, per-module counts) of one real diffusers forward at batch 1."""
    with flop_counter() as counter, torch.no_grad():
        transformer(hidden_states=torch.randn(latents_shape), timestep=torch.tensor([500.0]),
                    encoder_hidden_states=torch.randn(text_shape), return_dict=False)  # fmt: skip
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    blocks = sum(flops for name, flops in per_module.items() if re.fullmatch(r"\w+\.blocks\.\d+", name))
    assert blocks > 0
    return counter.get_total_flops(), blocks, per_module


def test_cached_request_flops_equal_an_independent_count(tiny_engine):
    card = tiny_engine.card
    positive, negative = embeds(4, card)
    requests = [Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=seed, guidance_scale=5.0,
                        num_inference_steps=STEPS, height=64, width=64, num_frames=5, output_type="latent", cache=CACHE)
                for seed in (4, 5)]  # fmt: skip
    tiny_engine.loop.caching._flops = None  # counted afresh: other tests of the session ran other signatures
    results = tiny_engine.generate(requests)
    assert all(r.ok for r in results)
    latents, text = tuple(results[0].latents.shape), (1, card.shapes.text_len, positive.shape[-1])
    forward, blocks, per_module = _forward_flops(tiny_engine.loop.components.transformer, latents, text)
    # The attention itself is counted, by hand: 2 FLOPs x (QK^T + AV) x heads x S x S x head_dim.
    config = tiny_engine.loop.components.transformer.config
    tokens = latents[2] * latents[3] // 2 * latents[4] // 2
    attn = per_module["WanTransformer3DModel.blocks.0.attn1"]
    projections = sum(per_module[f"WanTransformer3DModel.blocks.0.attn1.{p}"] for p in ("to_q", "to_k", "to_v", "to_out.0"))
    assert attn - projections == 2 * 2 * config.num_attention_heads * tokens * tokens * config.attention_head_dim
    for result in results:
        cache = result.cache
        assert cache["reused"] > 0 and cache["computed"] > 0
        assert cache["flops"] == cache["computed"] * forward + cache["reused"] * (forward - blocks)
        assert cache["flops_uncached"] == 2 * STEPS * forward
    counted = tiny_engine.loop.caching._flops._counted
    assert {signature.kind for signature in counted} == {"denoise_cfg_keep", "denoise_cfg_reuse", "denoise_cfg"}
    assert len(counted) == 3  # once per signature: the second request and every later step counted nothing
