"""Serving with submit + tick: requests join while others are mid-run, and nothing is lost."""

import pytest
import torch

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request, RequestRejected


def _request(name: str, seed: int, steps: int = 4, **extra) -> Request:
    return Request(prompt=name, seed=seed, num_inference_steps=steps, num_frames=5, guidance_scale=4.0,
                   output_type="latent", request_id=name, **extra)  # fmt: skip


def _drain(engine: Engine, on_step=None) -> dict:
    """Tick until every submitted request has come back; each result must come back once."""
    results = {}
    while engine.has_work():
        for result in engine.tick(on_step):
            assert result.request_id not in results, f"{result.request_id} came back twice"
            results[result.request_id] = result
    return results


def test_a_request_submitted_mid_run_joins_and_both_match_their_solo_runs(tiny_engine):
    first, late = _request("first", 1, steps=5), _request("late", 2, steps=3)
    solo = {r.request_id: tiny_engine.generate([r])[0] for r in (first, late)}
    steps = []
    record = lambda state, kind: steps.append((state.request_id, state.step_index)) if "denoise" in kind else None  # noqa: E731

    tiny_engine.submit(first)
    for _ in range(3):  # text encode, then two denoise steps
        assert tiny_engine.tick(record) == []
    tiny_engine.submit(late)
    results = _drain(tiny_engine, record)

    assert steps.index(("late", 1)) < steps.index(("first", 5))  # it joined mid-run, it did not queue behind
    assert set(results) == {"first", "late"}
    for name, result in results.items():
        assert result.ok and result.timings["total"] > 0
        assert torch.equal(result.latents, solo[name].latents)


def test_submit_rejects_bad_input_and_ids_still_in_flight(tiny_engine, tiny_card):
    with pytest.raises(RequestRejected, match="num_inference_steps"):
        tiny_engine.submit(_request("too-long", 1, steps=tiny_card.recipe.allowed_steps[1] + 1))
    assert not tiny_engine.has_work()

    tiny_engine.submit(_request("twice", 1, steps=2))
    with pytest.raises(RequestRejected, match="request_id: 'twice' is already in flight"):
        tiny_engine.submit(_request("twice", 2, steps=2))
    [result] = _drain(tiny_engine).values()
    assert result.ok and result.seed == 1  # the first one ran; the refused one left no trace
    tiny_engine.submit(_request("twice", 3, steps=2))  # handed back, so the id is free again
    assert _drain(tiny_engine)["twice"].seed == 3


def test_generate_beside_submitted_requests_keeps_their_results_for_tick(tiny_engine):
    tiny_engine.submit(_request("background", 4, steps=3))
    [foreground] = tiny_engine.generate([_request("foreground", 5, steps=6)])
    assert foreground.ok and foreground.request_id == "foreground"
    assert tiny_engine.has_work()  # background ended during generate(); its result waits for tick()
    assert _drain(tiny_engine)["background"].ok


def test_cancel_reaches_only_requests_in_flight(tiny_engine):
    assert not tiny_engine.cancel("later")  # not in flight: must not cancel a request submitted afterwards
    tiny_engine.submit(_request("later", 6, steps=2))
    tiny_engine.submit(_request("victim", 7, steps=6))
    tiny_engine.tick()
    assert tiny_engine.cancel("victim")
    results = _drain(tiny_engine)
    assert results["later"].ok
    assert results["victim"].status == "cancelled" and results["victim"].latents is None


def test_a_late_request_batches_with_the_running_one_without_recompiling(tiny_card):
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, buckets=BucketSpec(batch_sizes=(2,)),
                              compile_config=CompileConfig(backend="aot_eager"))  # fmt: skip
    first, late = _request("first", 1, steps=5), _request("late", 2, steps=3)
    solo = {r.request_id: engine.generate([r])[0] for r in (first, late)}
    engine.freeze()
    before = engine.counters.snapshot()
    engine.submit(first)
    engine.tick()
    engine.tick()
    engine.submit(late)
    results = _drain(engine)
    grew = engine.counters.since(before)
    assert grew["compiles"] == 0
    assert grew["batches"] < grew["compiled_steps"]  # some batch held both requests
    tol = tiny_card.parity.tolerance("fp32", "component")
    for name, result in results.items():
        torch.testing.assert_close(result.latents, solo[name].latents, atol=tol.atol, rtol=tol.rtol)


def test_a_failing_finalize_fails_only_its_request_and_the_engine_goes_idle(tiny_engine, monkeypatch):
    finalize = tiny_engine.loop.finalize

    def flaky(state):
        if state.request_id == "broken":
            raise RuntimeError("simulated decode-to-frames failure")
        return finalize(state)

    monkeypatch.setattr(tiny_engine.loop, "finalize", flaky)
    tiny_engine.submit(_request("broken", 1, steps=2))
    tiny_engine.submit(_request("fine", 2, steps=2))
    results = _drain(tiny_engine)  # ends: nothing is left in flight
    assert results["broken"].status == "failed" and "simulated decode-to-frames failure" in results["broken"].error
    assert results["fine"].ok
