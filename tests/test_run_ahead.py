"""Running ahead (fvgraph/engine/run_ahead.py) gives the serial order's results, bit for bit, with
arrivals, cancels and a failing row landing while the next batch is already launched."""

import pytest
import torch

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec

AOT = CompileConfig(backend="aot_eager", step_kinds=("denoise_cfg", "denoise"))


def _request(i: int, guidance: float, steps: int) -> Request:
    return Request(request_id=f"r{i}", prompt=f"prompt {i}", seed=10 + i, guidance_scale=guidance,
                   num_inference_steps=steps, num_frames=5, output_type="latent")  # fmt: skip


FIRST = [_request(0, 5.0, 4), _request(1, 1.0, 3), _request(2, 3.0, 5), _request(3, 7.5, 4), _request(4, 1.0, 5)]
LATE = {2: [_request(5, 4.0, 3)], 5: [_request(6, 1.0, 2), _request(7, 6.0, 4)]}  # tick -> arrivals
CANCELS = {4: ["r2"], 6: ["r7"]}  # tick -> cancels (r7 is still waiting then)
POISONED = ("r3", 2)  # this request's latents turn NaN after its step 2: its step 3 fails


@pytest.fixture(scope="module")
def engine():
    """max_running 3 and buckets 1/2: requests queue, two signatures (CFG or not) share a tick, and a
    group of three splits into two lanes."""
    return Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=AOT,
                            buckets=BucketSpec(batch_sizes=(1, 2)), max_running=3)  # fmt: skip


def _drive(engine: Engine, ahead: bool, monkeypatch) -> tuple[dict, dict]:
    """Serve the mix with its events injected at fixed ticks; results by id, and what was observed."""
    engine.run_ahead = ahead
    seen = {"ticks": 0, "launched_at_commit": 0, "early": 0}
    advance = engine.loop.advance

    def poisoning_advance(state, result):
        advance(state, result)
        if (state.request_id, state.step_index) == (POISONED[0], POISONED[1] + 1) and state.phase == "denoise":
            state.latents = torch.full_like(state.latents, float("nan"))

    def before_commit():
        seen["ticks"] += 1
        seen["launched_at_commit"] += engine._ahead.launched is not None  # the batch before is not settled yet
        for request in LATE.get(seen["ticks"], []):
            engine.submit(request)
        for request_id in CANCELS.get(seen["ticks"], []):
            assert engine.cancel(request_id)

    planned_ahead = engine._ahead.planned_ahead

    def counting_planned_ahead():
        tick = planned_ahead()
        seen["early"] += engine._ahead.early is not None  # the tick committed with its first batch launched
        return tick

    monkeypatch.setattr(engine.loop, "advance", poisoning_advance)
    monkeypatch.setattr(engine._ahead, "planned_ahead", counting_planned_ahead)
    engine.before_commit = before_commit
    before = engine.counters.snapshot()
    results = {}
    try:
        for request in FIRST:
            engine.submit(request)
        while engine.has_work():
            results.update((r.request_id, r) for r in engine.tick())
    finally:
        engine.before_commit = None
        engine.run_ahead = False
    seen.update(engine.counters.since(before))
    return results, seen


def test_running_ahead_gives_the_serial_results_bit_for_bit(engine, monkeypatch):
    serial, serial_seen = _drive(engine, False, monkeypatch)
    monkeypatch.undo()
    ahead, ahead_seen = _drive(engine, True, monkeypatch)
    assert sorted(serial) == sorted(ahead) == [f"r{i}" for i in range(8)]
    statuses = {rid: r.status for rid, r in serial.items()}
    assert statuses == {"r0": "ok", "r1": "ok", "r2": "cancelled", "r3": "failed", "r4": "ok", "r5": "ok",
                        "r6": "ok", "r7": "cancelled"}  # fmt: skip
    for rid, result in serial.items():
        other = ahead[rid]
        assert other.status == result.status and other.error == result.error, rid
        if result.ok:
            assert torch.equal(other.latents, result.latents), rid
    assert "not finite" in serial["r3"].error
    # The orders really differ: serially nothing is launched early and every batch is settled before
    # the next tick is committed; ahead, most ticks were committed with the batch before unsettled and
    # their first batch launched already. The events landing between that launch and the commit had
    # some early batches dropped and run again (a cancel, the failing row, an arrival joining the
    # first group), and only those: every other early batch served its tick.
    assert serial_seen["early"] == serial_seen["launched_at_commit"] == serial_seen["batches_redone"] == 0
    assert ahead_seen["launched_at_commit"] > ahead_seen["ticks"] // 2
    assert ahead_seen["early"] > ahead_seen["ticks"] // 2 and ahead_seen["batches_redone"] > 0
    assert ahead_seen["batches"] == serial_seen["batches"] + ahead_seen["batches_redone"]


def test_a_cpu_engine_runs_serially_unless_asked(engine):
    assert Engine.from_card("tiny-wan", device="cpu").run_ahead is False
    assert Engine.from_card("tiny-wan", device="cpu", run_ahead=True).run_ahead is True


def test_drain_settles_the_batch_a_tick_left_running_ahead(engine):
    """A tick running ahead returns with its last batch launched; drain() (which Engine.step,
    update_weights, load_lora and close call first) settles it, and the request still ends ok."""
    engine.run_ahead = True
    try:
        engine.submit(_request(20, 1.0, 2))
        engine.tick()  # text encode
        engine.tick()  # first denoise step, launched and left to settle
        assert engine._ahead.launched is not None
        engine.drain()
        assert engine._ahead.launched is None
        results = []
        while engine.has_work():
            results += engine.tick()
    finally:
        engine.run_ahead = False
    assert [r.status for r in results] == ["ok"]
