"""-O1: compiled step graphs serve whole multi-request runs with zero recompiles, within tolerance of eager."""

import pytest
import torch

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig, RecompileError
from fvgraph.engine.engine import Engine
from fvgraph.passes.manager import PassConfig
from fvgraph.request import Request
from fvgraph.loops import steps
from reference_helpers import assert_within_compiled_noise


def _mix():
    """Different prompts, seeds, guidance scales and step counts: one signature per step kind."""
    return [
        Request(prompt="a red fox", seed=1, guidance_scale=5.0, num_inference_steps=4, num_frames=5),
        Request(prompt="the sea", negative_prompt="fog", seed=2, guidance_scale=2.5, num_inference_steps=3, num_frames=5),
        Request(prompt="a cactus", seed=3, guidance_scale=8.0, num_inference_steps=5, num_frames=5, output_type="latent"),
    ]


@pytest.fixture(scope="module")
def compiled_engine():
    config = CompileConfig(backend="aot_eager", step_kinds=("denoise_cfg",))
    return Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=config)


def test_compiled_run_batches_matches_eager_and_compiles_once_per_bucket(compiled_engine, tiny_engine):
    # 4 + 3 + 5 denoise steps; the three requests share a batch while they all run (bucket 4, 3 ticks),
    # then two (bucket 2, 1 tick), then one (bucket 1, 1 tick): one compile per bucket, and one prologue,
    # whose hoisted values serve each request at every bucket.
    with compiled_engine.counters.expect(compiles=3, compiled_steps=12, batches=5, prologue_runs=1):
        compiled = compiled_engine.generate(_mix())
    eager = tiny_engine.generate(_mix())
    for ours, reference in zip(compiled, eager):
        assert ours.ok, ours.error
        assert_within_compiled_noise(ours.latents, reference.latents)
    assert sorted(s.batch for s in compiled_engine.compiler.signatures) == [1, 2, 4]
    for step in compiled_engine.compiler._compiled.values():
        assert step.passes_changed["cfg_fusion"] > 0 and step.prologue_fn is not None


def test_second_run_adds_no_compile(compiled_engine):
    with compiled_engine.counters.expect(compiles=0, compiled_steps=12):
        results = compiled_engine.generate(_mix())
    assert all(r.ok for r in results)
    assert all("compile" not in r.timings for r in results)


def test_after_warmup_a_new_signature_is_refused_naming_the_factor():
    # One batch bucket: the warmup compiles one graph rather than one per default bucket (1, 2, 4, 8);
    # the refusal does not depend on the buckets (warming every bucket: tests/test_scheduler.py).
    config = CompileConfig(backend="eager", step_kinds=("denoise_cfg",))
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=config, buckets=BucketSpec(batch_sizes=(1,)))
    engine.warmup([Request(prompt="warm", seed=0, num_inference_steps=2, num_frames=5)])
    with pytest.raises(RecompileError, match="shape"):
        engine.finish(engine.start(Request(prompt="wide", seed=0, num_inference_steps=2, num_frames=5, width=128)))
    other, same = engine.generate(
        [Request(prompt="tall", seed=0, num_inference_steps=2, num_frames=5, height=96),
         Request(prompt="same shape", seed=4, guidance_scale=3.0, num_inference_steps=3, num_frames=5)]
    )  # fmt: skip
    assert other.status == "failed" and "fail_on_recompile" in other.error
    assert same.ok


def test_enforce_eager_and_disable_pass():
    eager = Engine.from_card("tiny-wan", device="cpu", opt_level=1, enforce_eager=True)
    assert eager.compiler is None and eager.opt_level == 0
    config = CompileConfig(backend="eager", passes=PassConfig(disabled=("cfg_fusion", "hoist_invariants")))
    plain = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=config)
    [result] = plain.generate([Request(prompt="x", seed=0, num_inference_steps=2, num_frames=5)])
    assert result.ok
    assert all(step.prologue_fn is None for step in plain.compiler._compiled.values())


def test_inductor_compiled_step_matches_eager(tiny_engine):
    """The one cold inductor compile of the suite: the denoise step with both passes, through inductor,
    at one batch bucket of 2 (the lone last steps of the longer request run padded)."""
    config = CompileConfig(backend="inductor", step_kinds=("denoise_cfg",))
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=config, buckets=BucketSpec(batch_sizes=(2,)))
    requests = _mix()[:2]
    compiled, eager = engine.generate(requests), tiny_engine.generate(_mix()[:2])
    for ours, reference in zip(compiled, eager):
        assert ours.ok, ours.error
        assert_within_compiled_noise(ours.latents, reference.latents)
    assert engine.counters.compiles == 1


def _arrival_mix() -> tuple[Engine, list[Request]]:
    """A warm -O1 tiny-wan engine at buckets 1 and 4 (aot_eager), and five requests: four fill bucket
    4, the fifth arrives when the shortest one ends."""
    config = CompileConfig(backend="aot_eager", step_kinds=("denoise_cfg",))
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=config,
                              buckets=BucketSpec(batch_sizes=(1, 4)), max_running=4)  # fmt: skip
    requests = [Request(prompt=f"p{i}", seed=i, guidance_scale=2.0 + i, num_inference_steps=steps, num_frames=5,
                        output_type="latent") for i, steps in enumerate((2, 4, 5, 3, 3))]  # fmt: skip
    engine.warmup(requests[:1])
    return engine, requests


def test_an_arrival_into_a_running_batch_gets_its_hoisted_values_from_the_smallest_bucket(tiny_engine):
    """Four requests fill bucket 4; the fifth arrives when the shortest one ends, and its hoisted values
    come from the batch-1 prologue, not a bucket-4 one; as the batch shrinks to buckets 4 (padded) and
    1, every request keeps the values it has. Results agree with eager's batch-1 reference."""
    engine, requests = _arrival_mix()
    prologues = []
    for entry in engine.executor.runner._graphs.values():
        run, bucket = entry.compiled.prologue_fn, entry.bucket
        entry.compiled.prologue_fn = lambda *args, run=run, bucket=bucket: prologues.append(bucket) or run(*args)
    with engine.counters.expect(compiles=0, prologue_runs=2):
        ours = engine.generate(requests)
    assert prologues == [4, 1]
    for result, reference in zip(ours, tiny_engine.generate(requests)):
        assert result.ok, result.error
        assert_within_compiled_noise(result.latents, reference.latents)


def test_the_text_only_the_prologue_reads_is_written_for_its_requests_alone(tiny_engine):
    """Once hoisting moved every use of the texts into the prologue, the step no longer reads them:
    the runner writes them only for the requests a prologue computes at bucket 4, into their own rows,
    not into every row that changes hands; and the arrival's batch-1 prologue reads its own texts,
    copied into no buffer: its buffers hold NaN throughout. NaN poured into those buffers before every
    step reaches no result."""
    engine, requests = _arrival_mix()
    prologue_args, [single] = [], [e for e in engine.executor.runner._graphs.values() if e.bucket == 1]
    for entry in engine.executor.runner._graphs.values():
        assert entry.compiled.unread_inputs == {"prompt_embeds", "negative_prompt_embeds"}
        assert {name for name, _ in entry.prologue_constants} == entry.compiled.unread_inputs
        buffers, step = [buffer for _, buffer in entry.prologue_constants], entry.compiled.step_fn
        entry.compiled.step_fn = lambda *args, step=step, buffers=buffers: [b.fill_(float("nan")) for b in buffers] and step(*args)
        if entry.bucket == 1:
            run = entry.compiled.prologue_fn
            entry.compiled.prologue_fn = lambda *args, run=run: prologue_args.append(args) or run(*args)
            [b.fill_(float("nan")) for b in buffers]
    with engine.counters.expect(compiles=0, prologue_runs=2):
        ours = engine.generate(requests)
    [args] = prologue_args  # the arrival's
    assert not any(arg is buffer for arg in args for _, buffer in single.prologue_constants)
    assert all(buffer.isnan().all() for _, buffer in single.prologue_constants)
    for result, reference in zip(ours, tiny_engine.generate(requests)):
        assert result.ok, result.error
        assert_within_compiled_noise(result.latents, reference.latents)


@pytest.mark.parametrize("error", [1e-4, 5e-5])
def test_a_sampler_update_off_by_a_hundredth_of_a_percent_fails_the_compiled_tolerance(tiny_engine, tiny_card, monkeypatch, error):
    """COMPILED_TOLERANCE sees a 0.01% (and a 0.005%) systematic error in the compiled step's sampler
    update; the card's loop tolerance (atol 1e-4, rtol 1e-3), the gate before, lets the 0.005% one through."""
    exact = steps.sampler_update  # what DenoiseStep's forward calls, traced into the compiled step

    def off_by_a_fraction(sampler, latents, noise, carry, coeffs, fresh_noise=None):
        updated = exact(sampler, latents, noise, carry, coeffs, fresh_noise)
        return {**updated, "latents": latents + (1 + error) * (updated["latents"] - latents)}

    monkeypatch.setattr(steps, "sampler_update", off_by_a_fraction)
    config = CompileConfig(backend="aot_eager", step_kinds=("denoise_cfg",))
    perturbed = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=config).generate(_mix())
    monkeypatch.setattr(steps, "sampler_update", exact)
    eager = tiny_engine.generate(_mix())
    loose = tiny_card.parity.tolerance("fp32", "loop")
    for ours, reference in zip(perturbed, eager):
        with pytest.raises(AssertionError, match="not close"):
            assert_within_compiled_noise(ours.latents, reference.latents)
        if error == 5e-5:
            torch.testing.assert_close(ours.latents, reference.latents, atol=loose.atol, rtol=loose.rtol)
