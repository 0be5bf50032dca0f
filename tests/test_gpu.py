"""GPU checks (marked gpu; skipped without CUDA): the eager and compiled paths on a real device."""

import pytest
import torch

from fvgraph.compiler import CompileConfig
from fvgraph.engine import Engine
from fvgraph.request import Request

pytestmark = pytest.mark.gpu


def _requests():
    return [
        Request(prompt="a red fox", seed=1, num_inference_steps=4, num_frames=9),
        Request(prompt="waves", seed=2, guidance_scale=3.0, num_inference_steps=3, num_frames=9),
    ]


def test_cuda_eager_matches_cpu_eager(tiny_card):
    cpu = Engine.from_card("tiny-wan", device="cpu").generate(_requests())
    cuda = Engine.from_card("tiny-wan", device="cuda").generate(_requests())
    tol = tiny_card.parity.tolerance("fp32", "loop")
    for a, b in zip(cpu, cuda):
        assert b.ok, b.error
        torch.testing.assert_close(b.latents, a.latents, atol=tol.atol * 10, rtol=tol.rtol * 10)


def test_cuda_inductor_step_matches_eager_with_no_recompiles(tiny_card):
    eager = Engine.from_card("tiny-wan", device="cuda").generate(_requests())
    engine = Engine.from_card("tiny-wan", device="cuda", opt_level=1, compile_config=CompileConfig(backend="inductor"))
    engine.warmup(_requests()[:1])
    with engine.counters.expect(compiles=0, compiled_steps=7):
        compiled = engine.generate(_requests())
    tol = tiny_card.parity.tolerance("fp32", "loop")
    for a, b in zip(eager, compiled):
        assert b.ok, b.error
        torch.testing.assert_close(b.latents, a.latents, atol=tol.atol, rtol=tol.rtol)
