"""Parallel steps on CPU with gloo and 2 processes: CFG-parallel and Ulysses equal the single-process
run within the card's fp32 loop tolerance at -O0 and -O1, with their collectives inside the compiled
step graph; the interleave gate holds on a parallel engine; a killed worker fails its batch with a
clear error and the engine refuses new work (503 through the async front end)."""

import asyncio
import os
import re
import signal
import threading

import pytest
import torch
from pydantic import ValidationError

from typer.testing import CliRunner

from fvgraph.cards import get_card
from fvgraph.cli import app
from fvgraph.compile.compiler import CompileConfig
from fvgraph.parallel.config import ParallelConfig
from fvgraph.parallel.workers import WorkersLost
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.engine.engine import Engine
from fvgraph.serving.async_engine import AsyncEngine, EngineClosed

CARD = get_card("tiny-wan")
TOL = CARD.parity.tolerance("fp32", "loop")
# -O1 engines: aot_eager (no C++ compile) and one batch bucket, so a request alone and the same
# request beside another run through the same graph.
COMPILED = dict(opt_level=1, compile_config=CompileConfig(backend="aot_eager"), buckets=BucketSpec(batch_sizes=(2,)))


def _requests(kind: str) -> list[Request]:
    """Same shape, different step counts (rows change hands mid-run), guidance scales and prompts.
    "eager": guided, unguided (the plain denoise kind) and one decoded to frames; "guided" and
    "unguided": the -O1 sets, one compiled step kind each."""
    guided = [
        Request(prompt="a lighthouse at dusk", seed=1, num_inference_steps=3, output_type="latent"),
        Request(prompt="waves", negative_prompt="fog", seed=2, guidance_scale=7.5, num_inference_steps=2,
                output_type="latent"),  # fmt: skip
    ]
    if kind == "guided":
        return guided
    unguided = [
        Request(prompt="no guidance", seed=3, guidance_scale=1.0, num_inference_steps=3, output_type="latent"),
        Request(prompt="still none", seed=4, guidance_scale=1.0, num_inference_steps=2, output_type="latent"),
    ]
    if kind == "unguided":
        return unguided
    return [*guided, unguided[1], Request(prompt="frames", seed=5, num_inference_steps=2, num_frames=5)]


@pytest.fixture(scope="module")
def single_process():
    """The reference: each request set on one process (no projection cache, as the parallel engine)."""
    eager = Engine.from_card(CARD, device="cpu", projection_cache_bytes=0)
    compiled = Engine.from_card(CARD, device="cpu", **COMPILED)
    return {"eager": eager.generate(_requests("eager")), "guided": compiled.generate(_requests("guided")),
            "unguided": compiled.generate(_requests("unguided"))}  # fmt: skip


@pytest.fixture(scope="module")
def cfg_eager():
    """CFG-parallel at -O0, shared by the last tests of this file (a process belongs to one group at
    a time, so the other parallel engines come first and close); the killed-worker test ends it."""
    engine = Engine.from_card(CARD, device="cpu", parallel=ParallelConfig(cfg=2, timeout_s=30))
    yield engine
    engine.close()


def _check_equal_to_single_process(engine: Engine, kind: str, reference: list) -> None:
    together = engine.generate(_requests(kind))
    alone = [engine.generate([request])[0] for request in _requests(kind)]
    for ref, ours, serial in zip(reference, together, alone):
        assert ours.ok and serial.ok, (ours.error, serial.error)
        torch.testing.assert_close(ours.latents, ref.latents, atol=TOL.atol, rtol=TOL.rtol)
        assert torch.equal(serial.latents, ours.latents)  # the interleave gate, under parallelism
        if ref.frames is not None:
            assert abs(ours.frames.astype(int) - ref.frames.astype(int)).max() <= 1


def _check_compiled(engine: Engine, step_kind: str, collective: str, rank: int = 0) -> dict[str, int]:
    """Every denoise step ran compiled, as one graph holding the plan's collectives."""
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert graph_breaks == 0
    steps = engine.compiler.compiled_steps
    assert [s.signature.step_kind for s in steps] == [step_kind]
    assert steps[0].signature.parallel == engine.executor.group.config.plan(rank)
    assert engine.counters.compiled_steps > 0
    counts = steps[0].collectives
    assert counts.get(collective, 0) > 0, counts
    return counts


def test_parallel_config_is_public_beside_engine_and_request():
    import fvgraph

    assert fvgraph.ParallelConfig is ParallelConfig and "ParallelConfig" in fvgraph.__all__


@pytest.mark.gpu
def test_parallel_code_path_at_degree_1_on_cuda():
    """One GPU: the parallel engine at degree 1 (an NCCL group of one, the mesh, the parallel
    executor, the plan in the signature) runs -O2 with CUDA graphs and equals the plain engine."""
    options = dict(device="cuda", opt_level=2, buckets=BucketSpec(batch_sizes=(2,)))
    reference = Engine.from_card(CARD, projection_cache_bytes=0, **options).generate(_requests("guided"))
    engine = Engine.from_card(CARD, parallel=ParallelConfig(), **options)
    try:
        results = engine.generate(_requests("guided"))
        for ref, ours in zip(reference, results):
            assert ours.ok, ours.error
            torch.testing.assert_close(ours.latents, ref.latents, atol=TOL.atol, rtol=TOL.rtol)
        assert engine.counters.captures > 0 and engine.counters.replays > 0
        assert [s.signature.parallel for s in engine.compiler.compiled_steps] == ["cfg1xulysses1:rank0"]
    finally:
        engine.close()


def test_cli_parallel_flags(tmp_path):
    """--cfg-parallel 2 starts a worker rank that runs every guided denoise step with this process and
    says so; a bad degree is refused naming the flag, before anything loads."""
    out = tmp_path / "x.gif"
    bad = CliRunner().invoke(app, ["generate", "--cfg-parallel", "3", "--device", "cpu", "-o", str(out)])
    assert bad.exit_code == 2 and "--cfg-parallel=3 must be 1 or 2" in bad.output
    ok = CliRunner().invoke(app, ["generate", "--cfg-parallel", "2", "--ulysses", "1", "--steps", "2", "--frames", "5",
                                  "-O0", "--device", "cpu", "-o", str(out)])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert out.exists()
    assert re.search(r"parallel group of 2 ranks \(cfg=2, ulysses=1\): rank 1 \(pid \d+\) ran 2 step calls", ok.output), ok.output


def test_cfg_parallel_compiled_equals_single_process(single_process):
    engine = Engine.from_card(CARD, device="cpu", parallel=ParallelConfig(cfg=2), **COMPILED)
    try:
        _check_equal_to_single_process(engine, "guided", single_process["guided"])
        counts = _check_compiled(engine, "denoise_cfg", "_c10d_functional.all_gather_into_tensor")
        assert counts["_c10d_functional.all_gather_into_tensor"] == 1  # one gather of the noise
        # Frozen (after warmup), a new shape is refused on every rank alike, and the group serves on.
        engine.freeze()
        wider = engine.generate([Request(prompt="wider", seed=6, num_inference_steps=2, width=80, output_type="latent")])
        assert wider[0].status == "failed" and "fail_on_recompile" in wider[0].error
        again = engine.generate(_requests("guided")[:1])[0]
        assert again.ok, again.error
        torch.testing.assert_close(again.latents, single_process["guided"][0].latents, atol=TOL.atol, rtol=TOL.rtol)
    finally:
        engine.close()


def test_ulysses_eager_equals_single_process(single_process):
    engine = Engine.from_card(CARD, device="cpu", parallel=ParallelConfig(ulysses=2))
    try:
        _check_equal_to_single_process(engine, "eager", single_process["eager"])
    finally:
        engine.close()


def test_ulysses_compiled_equals_single_process(single_process):
    engine = Engine.from_card(CARD, device="cpu", parallel=ParallelConfig(ulysses=2), **COMPILED)
    try:
        # Without guidance: Ulysses' context-parallel hooks make tracing slow, and the guided kind traces
        # the same denoiser, once, at twice the batch (its branches fused before tracing).
        _check_equal_to_single_process(engine, "unguided", single_process["unguided"])
        _check_compiled(engine, "denoise", "_c10d_functional.all_to_all_single")
    finally:
        engine.close()


def test_bad_parallel_config_names_the_field():
    with pytest.raises(ValidationError, match="cfg"):
        ParallelConfig(cfg=3)
    with pytest.raises(ValidationError, match="ulysses"):
        ParallelConfig(ulysses=0)
    with pytest.raises(ValidationError, match="tensor"):
        ParallelConfig(tensor=2)
    with pytest.raises(ValueError, match=r"ulysses=3 must divide the denoiser's attention head count \(2\)"):
        Engine.from_card(CARD, device="cpu", parallel=ParallelConfig(ulysses=3))  # before any process starts


def test_cfg_parallel_eager_equals_single_process(cfg_eager, single_process):
    _check_equal_to_single_process(cfg_eager, "eager", single_process["eager"])


def test_step_caching_kind_is_refused_by_name(cfg_eager):
    cached = Request(prompt="x", seed=5, num_inference_steps=4, output_type="latent",
                     cache={"method": "magcache", "threshold": 0.06, "mag_ratios": [1.0] + [0.99] * 3})  # fmt: skip
    result = cfg_eager.generate([cached])[0]
    assert result.status == "failed"
    assert "has no parallel plan" in result.error


def test_killed_worker_fails_the_batch_and_the_engine_refuses_new_work(cfg_eager):
    """Runs last on the shared engine: it ends it."""
    worker = cfg_eager.executor.group.processes[0]

    def kill_after_first_denoise(state, kind):
        if kind.startswith("denoise") and worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)

    outcome = {}
    run = threading.Thread(target=lambda: outcome.update(results=cfg_eager.generate(
        _requests("guided"), on_step=kill_after_first_denoise)))  # fmt: skip
    run.start()
    run.join(timeout=120)  # bounded: a hang fails here rather than stalling the suite
    assert not run.is_alive(), "the engine hung after its worker died"
    results = outcome["results"]
    assert [r.status for r in results] == ["failed", "failed"]
    assert all("worker rank 1" in r.error and f"pid {worker.pid}" in r.error for r in results), results[0].error
    assert cfg_eager.unavailable is not None
    with pytest.raises(WorkersLost, match="takes no new requests"):
        cfg_eager.submit(Request(prompt="after", seed=9))

    async def submit_to_server():
        async with AsyncEngine(cfg_eager) as served:
            served.submit(Request(prompt="after", seed=9))

    with pytest.raises(EngineClosed, match="worker rank 1"):  # the HTTP app answers EngineClosed with 503
        asyncio.run(submit_to_server())
