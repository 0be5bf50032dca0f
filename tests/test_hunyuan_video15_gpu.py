"""HunyuanVideo-1.5 text-to-video on CUDA: -O2 (inductor, the fused CFG step and the one-branch step
captured as CUDA graphs) equals -O0 within the card's tolerances, tap by tap and on the final
latents, and a second wave of the same requests replays the graphs with no compile and no capture."""

from __future__ import annotations

import pytest
import torch

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.parity import Setting, compare
from fvgraph.request import Request

CARD = "tiny-hunyuanvideo1.5"


def _requests() -> list[Request]:
    """One request with CFG, a negative text and a quoted glyph text; one without CFG (a one-branch step)."""
    return [Request(prompt='a sign saying "hi"', negative_prompt="blurry", guidance_scale=4.0, seed=1, num_inference_steps=3,
                    num_frames=5, output_type="latent", request_id="cfg"),
            Request(prompt="a blue bird", guidance_scale=1.0, seed=2, num_inference_steps=3, num_frames=9, output_type="latent",
                    request_id="no-cfg")]  # fmt: skip


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_tap_by_tap():
    """Every tap (block outputs, each branch's prediction, the guided noise, the latents) of -O2 against
    -O0 on CUDA, within the card's component tolerance."""
    report = compare(CARD, _requests(), Setting(0), Setting(2), device="cuda")
    assert report.passed, report.first_divergence
    assert {c.tap for c in report.comparisons} >= {"tap.noise", "tap.latents", "tap.block.1.0", "tap.block.1.1"}


@pytest.mark.gpu
def test_cuda_graph_replays_equal_eager_and_a_second_wave_compiles_nothing():
    eager = Engine.from_card(CARD, device="cuda").generate(_requests())
    graphs = Engine.from_card(CARD, device="cuda", opt_level=2, compile_config=CompileConfig(backend="inductor"))
    first = graphs.generate(_requests())
    assert graphs.counters.captures >= 2, graphs.counters.snapshot()  # the CFG step and the one-branch step
    replays = graphs.counters.replays
    with graphs.counters.expect(compiles=0, captures=0, fallbacks=0):
        second = graphs.generate(_requests())
    assert graphs.counters.replays > replays
    tol = graphs.card.parity.tolerance("fp32", "loop")
    for reference, *compiled in zip(eager, first, second):
        for result in compiled:
            assert result.ok, result.error
            print(f"{result.request_id}: max abs {(result.latents - reference.latents).abs().max().item():.2e}")
            torch.testing.assert_close(result.latents, reference.latents, atol=tol.atol, rtol=tol.rtol)
