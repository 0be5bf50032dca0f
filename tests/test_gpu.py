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


def _graph_engine(**kwargs):
    from fvgraph.buckets import BucketSpec

    return Engine.from_card(
        "tiny-wan", device="cuda", opt_level=2, compile_config=CompileConfig(backend="inductor"),
        buckets=BucketSpec(batch_sizes=(1, 2, 4)), **kwargs,
    )  # fmt: skip


def test_buckets_capture_into_one_pool_and_replay_equals_the_compiled_step(tiny_card):
    graphs = _graph_engine(debug=True)
    graphs.warmup(_requests()[:1])
    assert graphs.counters.captures == 3  # buckets 4, 2, 1, one shared pool
    runner = graphs.executor.runner
    assert runner._pool is not None and all(e.graph is not None for e in runner._graphs.values())
    with graphs.counters.expect(compiles=0, captures=0):
        replayed = graphs.generate(_requests())
    assert graphs.counters.replays > 0
    plain = _graph_engine(cuda_graphs=False).generate(_requests())
    for a, b in zip(plain, replayed):
        assert b.ok, b.error
        torch.testing.assert_close(b.latents, a.latents, atol=1e-5, rtol=1e-5)


def test_outputs_survive_later_replays():
    engine = _graph_engine()
    first = engine.start(Request(prompt="first", seed=1, num_inference_steps=3, num_frames=9))
    second = engine.start(Request(prompt="second", seed=2, num_inference_steps=3, num_frames=9))
    for state in (first, second):
        engine.step(state)  # text encode
    engine.step(first)
    kept = first.latents.clone()
    engine.step(second)  # replays the same bucket-1 graph with other inputs
    assert torch.equal(first.latents, kept)
