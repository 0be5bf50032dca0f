"""GPU-path mechanisms exercised on a CPU: a failed CUDA graph capture, inductor's config order, the
SDPA choice in inductor's cache key, loading a built artifact in a child process, and fp32 math."""

import contextlib
import itertools
import logging
import signal
from types import SimpleNamespace

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import fvgraph.compile.graph_artifact as graph_artifact
from fvgraph.compile.compiler import AttentionChoice, CompileConfig
from fvgraph.contract.counters import Counters
from fvgraph.engine.engine import Engine
from fvgraph.runtime.tf32_switch import math_mode
from fvgraph.runtime.graph_capture import CaptureError, capture_graph
from fvgraph.runtime.graph_runner import GraphRunner
from fvgraph.request import Request


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's capture API, faked: the graph context reacts to an error in its body the way
    torch.cuda.graph's exit does (capture_end raises its own error). Records what cleanup calls."""
    calls, pools = [], itertools.count(1)

    class Stream:
        def wait_stream(self, other):
            pass

    previous = Stream()

    @contextlib.contextmanager
    def graph(cuda_graph, pool):
        try:
            yield
        except Exception:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: previous)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: calls.append(("set_stream", s)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(pools)))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: calls.append(("end", d, p)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, p: calls.append(("release", d, p)), raising=False)
    return SimpleNamespace(calls=calls, previous=previous)


def _step_failing_at(call: int):
    """A step function whose `call`-th call (1-based) raises, as an op that cannot be captured does."""
    count = itertools.count(1)

    def step(x):
        if next(count) == call:
            raise RuntimeError("operation not permitted when stream is capturing")
        return (x + 1,)

    return step


def test_failed_capture_restores_the_stream_and_releases_the_pool(fake_cuda):
    with pytest.raises(CaptureError) as caught:
        capture_graph(_step_failing_at(3), [torch.zeros(2)], pool=(0, 7))  # calls 1-2 warm up, 3 is captured
    message = str(caught.value)
    assert "previous error during capture" in message and "not permitted when stream is capturing" in message
    assert fake_cuda.calls == [("set_stream", fake_cuda.previous), ("end", 0, (0, 7)), ("release", 0, (0, 7))]


def test_a_capture_that_ended_its_pool_routing_is_not_released_twice(fake_cuda, monkeypatch):
    def already_ended(device, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", already_ended, raising=False)
    with pytest.raises(CaptureError):
        capture_graph(_step_failing_at(3), [torch.zeros(2)], pool=(0, 7))
    assert fake_cuda.calls == [("set_stream", fake_cuda.previous)]


def test_after_a_failed_capture_the_next_bucket_captures_into_a_fresh_pool(fake_cuda):
    runner = GraphRunner(compiler=SimpleNamespace(capture_cache=None), counters=Counters(), cuda_graphs=True)

    def entry(step_fn):
        compiled = SimpleNamespace(step_fn=step_fn, signature=SimpleNamespace(step_kind="denoise"))
        return SimpleNamespace(compiled=compiled, args=[torch.zeros(2)], bucket=1, graph=None, outputs=())

    failing, fine = entry(_step_failing_at(3)), entry(_step_failing_at(0))
    runner._capture(failing, ("a", 1, 0))
    assert failing.graph is None and ("a", 1, 0) in runner._capture_failed and runner._pool is None
    runner._capture(fine, ("b", 1, 0))
    assert fine.graph == "graph" and runner._pool == (0, 2) and runner.counters.captures == 1
    assert ("release", 0, (0, 1)) in fake_cuda.calls


def _patches(mode="default", attention="default"):
    from fvgraph.compile.compiler import StepCompiler

    compiler = StepCompiler(CompileConfig(mode=mode), "tiny-wan", "w", "t2v", "fp32", torch.device("cpu"), Counters())
    return compiler._inductor_patches(attention)


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_a_compile_mode_cannot_turn_inductors_cuda_graphs_back_on(mode):
    assert torch._inductor.list_mode_options(mode)["triton.cudagraphs"] is True  # what the mode would set
    patches = _patches(mode)
    assert patches["triton.cudagraphs"] is False
    with torch._inductor.config.patch(patches):  # every key is a real inductor setting
        assert torch._inductor.config.triton.cudagraphs is False


def test_the_sdpa_choice_reaches_inductors_cache_key():
    assert "post_grad_custom_pre_pass" not in _patches()
    cudnn_first, flash_first = _patches(attention="CUDNN_ATTENTION,MATH"), _patches(attention="FLASH_ATTENTION,MATH")
    assert isinstance(cudnn_first["post_grad_custom_pre_pass"], AttentionChoice)
    assert cudnn_first["post_grad_custom_pre_pass"].uuid() != flash_first["post_grad_custom_pre_pass"].uuid()
    # inductor folds a CustomGraphPass's uuid() into its cache keys (FX graph and AOTAutograd caches)
    assert isinstance(cudnn_first["post_grad_custom_pre_pass"], CustomGraphPass)
    with torch._inductor.config.patch(cudnn_first):
        assert torch._inductor.config.post_grad_custom_pre_pass.uuid() == "fvgraph-sdpa:CUDNN_ATTENTION,MATH"


def test_an_artifact_loads_in_a_child_process(tmp_path):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    path = tmp_path / "step.pt2"
    graph_artifact.save_graph(gm, [torch.randn(1, 3)], "aot_eager", path, {})
    assert graph_artifact.load_in_child([path], "aot_eager", torch.device("cpu")) is None
    (tmp_path / "bad.pt2").write_bytes(b"not an artifact")
    problem = graph_artifact.load_in_child([tmp_path / "bad.pt2"], "aot_eager", torch.device("cpu"))
    assert problem is not None and "exit code 1" in problem


def test_a_loader_that_crashes_takes_only_the_child_down(monkeypatch, tmp_path):
    monkeypatch.setattr(graph_artifact, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    problem = graph_artifact.load_in_child([tmp_path / "step.pt2"], "inductor", torch.device("cpu"))
    assert problem is not None and signal.Signals.SIGSEGV.name in problem


def test_fp32_steps_run_without_tf32_and_the_callers_settings_come_back(tiny_card):
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    seen = []
    try:
        engine = Engine.from_card(tiny_card, device="cpu")
        assert engine.card.recipe.precision == "fp32"
        engine.loop.components.transformer.register_forward_pre_hook(
            lambda module, args: seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)))
        engine.generate([Request(prompt="a", seed=0, num_inference_steps=1, num_frames=5)])
        assert seen and all(flags == (False, False) for flags in seen)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
    assert isinstance(math_mode("bf16"), contextlib.nullcontext)


def test_the_fp32_context_nests_and_gives_the_settings_back_at_the_outermost_exit():
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    math = math_mode("fp32")
    try:
        with math:
            with math:  # warmup compiling from inside a held generate()
                assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, False)
            assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, False)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, True)
        with math:  # reusable after the outermost exit
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_tf32_set_through_the_new_api_is_refused_naming_the_cause():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"  # torch then refuses reads of the legacy allow_tf32
    try:
        with pytest.raises(RuntimeError, match=r"set TF32 through torch's fp32_precision API .* fvgraph's fp32 context"):
            with math_mode("fp32"):
                pass
    finally:
        matmul.fp32_precision = before
    with math_mode("fp32"):
        assert torch.backends.cuda.matmul.allow_tf32 is False


def test_every_load_is_logged_first_and_a_child_crash_shows_its_stack(monkeypatch, tmp_path, caplog):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    path = tmp_path / "step.pt2"
    graph_artifact.save_graph(gm, [torch.randn(1, 3)], "aot_eager", path, {})
    with caplog.at_level(logging.INFO, logger="fvgraph.compile.graph_artifact"):
        graph_artifact.load_graph(path, "aot_eager", torch.device("cpu"), lambda g, args: g)
    assert f"loading the aot_eager artifact {path} on cpu" in caplog.text
    # A crash two calls deep, after a log line, with an extension module loaded (the H200's crash report
    # listed 180 of them after a stack cut to its outermost frame).
    crash = ("import logging, os, signal, numpy\nlogging.basicConfig(level=logging.INFO)\n"
             "logging.getLogger('load').info('loading step.pt2')\n"
             "def open_package(): os.kill(os.getpid(), signal.SIGSEGV)\ndef load_graph(): open_package()\nload_graph()\n")  # fmt: skip
    monkeypatch.setattr(graph_artifact, "_CHILD", crash)
    problem = graph_artifact.load_in_child([path], "inductor", torch.device("cpu"))
    assert "SIGSEGV" in problem and "loading step.pt2" in problem
    assert all(frame in problem for frame in ("in open_package", "in load_graph", 'File "<string>", line 6'))
    assert "Extension modules" not in problem and "numpy" not in problem
    monkeypatch.setattr(graph_artifact, "_CHILD", "import time; time.sleep(5)")
    assert "took over 1 s in a child process" in graph_artifact.load_in_child([path], "inductor", torch.device("cpu"), timeout_s=1)
    assert graph_artifact.CHILD_LOAD_TIMEOUT_S == 120.0


def test_a_package_built_in_a_child_process_loads_and_runs_like_the_graph(tmp_path):
    """The AOTInductor build of the GPU path, on the CPU: exported here, built in a child, loaded here."""
    linear = torch.nn.Linear(3, 2)
    gm = torch.fx.symbolic_trace(lambda x, w, b: (torch.nn.functional.linear(x, w, b),))
    args = [torch.randn(4, 3), linear.weight.detach(), linear.bias.detach()]
    path = tmp_path / "step.pt2"
    graph_artifact.save_graph_in_child(gm, args, path, {})
    loaded = graph_artifact.load_graph(path, "inductor", torch.device("cpu"), lambda g, a: g)
    torch.testing.assert_close(loaded(*args)[0], gm(*args)[0])
    with pytest.raises(RuntimeError, match=r"was not built: a child process building it ended with exit code 1"):
        graph_artifact.save_graph_in_child(gm, args, tmp_path / "x.pt2", {"no_such_inductor_option": 1})


def test_a_step_whose_package_does_not_load_is_compiled_in_process_and_not_built_again(monkeypatch, tmp_path, caplog):
    """The GPU path (packages built, then loaded, in child processes) with a loader that crashes, as
    torch 2.11's did on an H200: the step is served compiled in process, the cache remembers, and a
    later process with the same identity compiles in process at once instead of building packages again
    (minutes each on a GPU); a cleared cache tries again."""
    from typer.testing import CliRunner

    import fvgraph.compile.compiler as compiler
    from fvgraph.cli import app
    from fvgraph.compile.capture_cache import clear

    built = []

    def build(gm, args, path, patches):  # the child's build, without a child: aot_eager's export
        built.append(path.name)
        graph_artifact.save_graph(gm, args, "aot_eager", path, patches)

    crash = "a child process loading it ended with killed by SIGSEGV: Fatal Python error: Segmentation fault"
    monkeypatch.setattr(compiler.StepCompiler, "_aoti_in_child", property(lambda self: True))
    monkeypatch.setattr(compiler, "save_graph_in_child", build)
    monkeypatch.setattr(compiler, "load_in_child", lambda paths, backend, device: crash)

    def engine():
        from fvgraph.runtime.buckets import BucketSpec

        return Engine.from_card("tiny-wan", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                cache_dir=tmp_path, buckets=BucketSpec(batch_sizes=(1,)))  # fmt: skip

    request = [Request(prompt="a red fox", seed=1, num_inference_steps=3, num_frames=9)]
    eager = Engine.from_card("tiny-wan").generate(request)[0]
    first = engine()
    with first.counters.expect(compiles=1, capture_cache_hits=0, capture_cache_stores=0):
        assert first.generate(request)[0].ok
    assert built == ["step.pt2", "prologue.pt2"]
    (key,) = first.compiler.capture_cache.unloadable_keys()
    assert crash in first.compiler.capture_cache.unloadable_keys()[key]["problem"]

    built.clear()
    later = engine()
    with caplog.at_level(logging.WARNING, logger="fvgraph.compile.compiler"):
        with later.counters.expect(compiles=1, capture_cache_hits=0, capture_cache_stores=0):
            result = later.generate(request)[0]
    assert built == []  # not built again
    listing = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path)])
    assert f"{key} is compiled in process: its packages, built here, did not load" in " ".join(listing.output.split())
    assert "its packages, built here before, did not load" in caplog.text and "SIGSEGV" in caplog.text
    torch.testing.assert_close(result.latents, eager.latents, atol=1e-5, rtol=1e-4)

    clear(tmp_path)
    engine().generate(request)
    assert built == ["step.pt2", "prologue.pt2"]  # a cleared cache builds again
