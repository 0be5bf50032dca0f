"""A step-caching method's settings as the diffusers hook config with the same settings, for the
benchmark's diffusers cases (perf/bench_interceptors.py: `transformer.enable_cache(config)`).

This lives beside the benchmark, not in fvgraph/caching/: diffusers' hook configs come with
`diffusers.hooks`, which imports peft and dynamo, and the runtime itself never builds them.
"""

from __future__ import annotations

import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from fvgraph.caching.fb_cache import FirstBlockCacheSettings
from fvgraph.caching.mag_cache import MagCacheSettings
from fvgraph.caching.settings import CacheSettings
from fvgraph.caching.taylor_seer import TaylorSeerSettings


def diffusers_cache_config(settings: CacheSettings, num_inference_steps: int) -> object | None:
    """The diffusers hook config `transformer.enable_cache()` takes with the same settings as
    `settings`, or None where diffusers has no such method (TeaCache)."""
    if isinstance(settings, FirstBlockCacheSettings):
        return FirstBlockCacheConfig(threshold=settings.threshold)
    if isinstance(settings, TaylorSeerSettings):
        # Its lite mode: the one that acts on Wan (fvgraph/caching/taylor_seer.py's docstring says why).
        return TaylorSeerCacheConfig(cache_interval=settings.cache_interval, disable_cache_before_step=settings.disable_cache_before_step,
                                     disable_cache_after_step=settings.disable_cache_after_step, max_order=settings.max_order,
                                     taylor_factors_dtype=getattr(torch, settings.taylor_factors_dtype), use_lite_mode=True)  # fmt: skip
    if isinstance(settings, MagCacheSettings):
        return MagCacheConfig(threshold=settings.threshold, max_skip_steps=settings.max_skip_steps,
                              retention_ratio=settings.retention_ratio, num_inference_steps=num_inference_steps,
                              mag_ratios=list(settings.mag_ratios))  # fmt: skip
    return None
