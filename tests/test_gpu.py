"""GPU checks (marked gpu; skipped without CUDA): the eager and compiled paths on a real device."""

import pytest
import torch

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request

pytestmark = pytest.mark.gpu


def _requests():
    return [
        Request(prompt="a red fox", seed=1, num_inference_steps=4, num_frames=9),
        Request(prompt="waves", seed=2, guidance_scale=3.0, num_inference_steps=3, num_frames=9),
    ]


def test_cuda_eager_matches_cpu_eager(tiny_card):
    """Both engines run fp32 math (TF32 off for cuDNN's patch-embedding Conv3d too: fvgraph/runtime/tf32_switch.py),
    so what remains is the order CPU and CUDA kernels reduce in. That ulp-level difference grows through
    the guided steps (guidance multiplies the branch difference), hence ten times the loop tolerance."""
    assert torch.backends.cudnn.allow_tf32  # torch's default: the engine, not this test, turns it off
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
    from fvgraph.runtime.buckets import BucketSpec

    kwargs.setdefault("buckets", BucketSpec(batch_sizes=(1, 2, 4)))
    kwargs.setdefault("compile_config", CompileConfig(backend="inductor"))
    return Engine.from_card("tiny-wan", device="cuda", opt_level=2, **kwargs)


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


def test_long_bf16_attention_compiles_with_the_measured_sdpa_backend():
    """Wan 1.3B at 480x832x33 is 14k tokens of head_dim 128: the table puts cuDNN first on an H100/H200."""
    engine = Engine.from_card("tiny-wan", device="cuda", opt_level=1, compile_config=CompileConfig(backend="aot_eager"))
    step = engine.executor.steps["denoise_cfg"]
    step.attention_shape = lambda inputs: (14040, 128, torch.bfloat16)  # the 1.3B shape, without its weights
    state = engine.start(_requests()[0])
    engine.step(state)  # text encode
    signature = engine.compiler.signature(engine.loop.next(state), 1, step)
    expected = "CUDNN_ATTENTION" if torch.cuda.get_device_capability() == (9, 0) else "FLASH_ATTENTION"
    assert signature.attention.split(",")[0] == expected


@pytest.mark.parametrize("artifact_format", ["standalone", "aoti"])
def test_capture_cache_serves_graphs_on_cuda_with_zero_compiles(tiny_card, tmp_path, artifact_format):
    """Standalone artifacts and AOTInductor packages load on the GPU and are captured into CUDA graphs
    like in-process compiles. One bucket: each package costs over a minute to build on an H200."""
    from fvgraph.runtime.buckets import BucketSpec

    one_bucket, config = BucketSpec(batch_sizes=(1,)), CompileConfig(backend="inductor", artifact_format=artifact_format)
    warm_up = _graph_engine(cache_dir=tmp_path, buckets=one_bucket, compile_config=config)
    reference = warm_up.warmup(_requests()[:1])
    served = _graph_engine(cache_dir=tmp_path, buckets=one_bucket, compile_config=config)
    with served.counters.expect(compiles=0, capture_cache_hits=1):
        results = served.warmup(_requests()[:1])
    assert served.counters.captures >= 1 and served.counters.replays > 0
    assert all("capture_seconds" in record["meta"] for record in served.compiler.capture_cache.entries().values())
    torch.testing.assert_close(results[0].latents, reference[0].latents, atol=0, rtol=0)


def test_o3_fp8_on_cuda_stays_within_the_fp8_tolerance(tiny_card):
    eager = Engine.from_card("tiny-wan", device="cuda").generate(_requests())
    engine = Engine.from_card("tiny-wan", device="cuda", opt_level=3, compile_config=CompileConfig(backend="inductor"))
    tol = tiny_card.parity.tolerance("fp8", "loop")
    for a, b in zip(eager, engine.generate(_requests())):
        assert b.ok, b.error
        torch.testing.assert_close(b.latents, a.latents, atol=tol.atol, rtol=tol.rtol)


def test_fresh_noise_drawn_each_step_gives_the_serial_results_running_ahead():
    """tiny-wan-4step's sampler draws fresh noise on the host every step, in `advance`, while the batch
    just launched still runs; that noise (and an arrival's schedule) reaches the device through pinned
    memory without waiting for the stream (denoise_state.to_device). Running ahead must still give the
    serial results bit for bit: a copy racing its pinned source would not."""
    from fvgraph.runtime.buckets import BucketSpec

    requests = lambda: [Request(request_id=f"r{i}", prompt=f"p{i}", seed=i, num_inference_steps=4, num_frames=9,  # noqa: E731
                                output_type="latent") for i in range(5)]  # fmt: skip
    results = {}
    for ahead in (False, True):
        engine = Engine.from_card("tiny-wan-4step", device="cuda", opt_level=2, compile_config=CompileConfig(backend="aot_eager"),
                                  buckets=BucketSpec(batch_sizes=(1, 2)), max_running=3, run_ahead=ahead)  # fmt: skip
        results[ahead] = engine.generate(requests())
        assert engine.counters.replays > 0
    for serial, ahead in zip(results[False], results[True]):
        assert serial.ok and ahead.ok, (serial.error, ahead.error)
        assert torch.equal(serial.latents, ahead.latents)
