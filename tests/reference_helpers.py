"""What the diffusers-reference tests share: a reference pipeline loaded apart from the engine, the
check that the two share no weight storage, and the tolerance an fp32 engine is held to against it.

REFERENCE_TOLERANCE comes from the measured noise between eager fvgraph and diffusers' pipelines in
fp32 on CPU (torch 2.11, diffusers 0.42.1). Every reference comparison prints its differences, so the
measurement is this command (18 comparisons: plain, I2V, two experts, TI2V and the four step-caching
methods):

    .venv/bin/python -m pytest tests/test_diffusers_reference.py tests/test_i2v.py tests/test_two_experts.py \
        tests/test_ti2v.py tests/test_tea_cache.py tests/test_mag_cache.py tests/test_fb_cache.py \
        tests/test_taylor_seer.py -k "(pipeline or pipelines or diffusers or transcribed) and not small_fraction" \
        -rP | grep "reference diff"

On 2026-12-01 the largest it printed were max |ours - reference| = 3.34e-06 (test_taylor_seer.py,
first_order) and, where |reference| > 0.1, max |ours - reference| / |reference| = 1.39e-05; the other
comparisons were 0.7e-06 to 2.6e-06. The tolerance is about nine times the largest: atol 3e-5 with
rtol 0 (a relative term would widen it for the large values). A systematic error of 0.1% in the
sampler update moves the latents by 1.5e-03 and one of 0.005% by 7e-05: both fail it, and the smaller
one passes the card's loop tolerance (atol 1e-4, rtol 1e-3), which stays the gate for compiled
against eager (test_diffusers_reference.py holds both).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from fvgraph.card import Tolerance

REFERENCE_TOLERANCE = Tolerance(atol=3e-5, rtol=0.0)
# Compiled (-O1, aot_eager or inductor, any batch bucket) against eager fvgraph in fp32 on the CPU:
# the tiny-wan mix of tests/test_compiled_engine.py measured 1.07e-06 to 3.81e-06 max |compiled - eager|
# on 2026-12-05 (torch 2.13; aot_eager and inductor alike), and every comparison held to this prints
# its own ("compiled diff"; the step-caching and FLUX tests printed 0 to 2.62e-06). About ten times the
# largest, with no relative term; a 0.01% (and a 0.005%) error in the sampler update fails it
# (test_a_sampler_update_off_by_a_hundredth_of_a_percent_fails_the_compiled_tolerance).
COMPILED_TOLERANCE = Tolerance(atol=4e-5, rtol=0.0)


def reference_pipeline(pipeline_class, folder: str | Path, **overrides):
    """diffusers' `pipeline_class` loaded by its own from_pretrained from `folder`, on CPU in fp32:
    module instances of its own, nothing of fvgraph bound into them."""
    return pipeline_class.from_pretrained(folder, dtype=torch.float32, **overrides)


def saved_pipeline(pipeline_class, components, folder: str | Path, **config) -> Path:
    """Write a diffusers checkpoint of `components` (a fvgraph Components) with `pipeline_class`'s
    own save_pretrained, for reference_pipeline and the engine to load each on its own."""
    accepted = inspect.signature(pipeline_class.__init__).parameters
    parts = {name: module for name, module in components.modules().items() if name in accepted}
    pipeline_class(**parts, **config).save_pretrained(folder)
    return Path(folder)


def _storage(modules) -> set[int]:
    return {t.data_ptr() for m in modules if isinstance(m, nn.Module) for t in m.state_dict().values() if t.numel()}


def assert_shares_no_storage(engine, pipeline) -> None:
    """The engine's weights and the reference's are different memory (parameters and buffers)."""
    ours, theirs = _storage(engine.loop.components.modules().values()), _storage(pipeline.components.values())
    assert ours and theirs, "both sides hold weights"
    assert not ours & theirs, f"{len(ours & theirs)} tensors shared between the engine and the reference pipeline"


def assert_matches_reference(latents: torch.Tensor, reference: torch.Tensor) -> None:
    """Hold fp32 latents to the reference within REFERENCE_TOLERANCE, printing the differences seen."""
    reference = reference.to(latents.dtype)
    diff = (latents - reference).abs()
    large = reference.abs() > 0.1
    relative = (diff[large] / reference.abs()[large]).max().item() if large.any() else 0.0
    print(f"reference diff: max abs {diff.max().item():.2e}, max rel (|ref| > 0.1) {relative:.2e}")
    tol = REFERENCE_TOLERANCE
    torch.testing.assert_close(latents, reference, atol=tol.atol, rtol=tol.rtol)


def assert_within_compiled_noise(compiled: torch.Tensor, eager: torch.Tensor) -> None:
    """Hold a compiled run's fp32 latents to the eager run's within COMPILED_TOLERANCE, printing the difference."""
    print(f"compiled diff: max abs {(compiled - eager).abs().max().item():.2e}")
    torch.testing.assert_close(compiled, eager, atol=COMPILED_TOLERANCE.atol, rtol=COMPILED_TOLERANCE.rtol)
