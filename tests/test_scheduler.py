"""The scheduler and graph runner: batching across requests, inert padding, cancellation, fallback, FIFO."""

import pytest
import torch

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.contract.plan import Done, WorkPlan
from fvgraph.request import Request

AOT = CompileConfig(backend="aot_eager", step_kinds=("denoise_cfg",))


def _mix():
    """Different seeds, guidance scales and step counts at one shape: they batch together."""
    return [
        Request(prompt="a red fox", seed=1, guidance_scale=5.0, num_inference_steps=4, num_frames=5),
        Request(prompt="the sea", seed=2, guidance_scale=2.0, num_inference_steps=3, num_frames=5),
        Request(prompt="a cactus", seed=3, guidance_scale=9.0, num_inference_steps=5, num_frames=5),
    ]


@pytest.fixture(scope="module")
def batched():
    """One compiled engine with a single bucket of 4: every group of 1-3 requests is padded to 4."""
    return Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=AOT, buckets=BucketSpec(batch_sizes=(4,)))


def test_batched_and_padded_equals_each_request_alone(batched, tiny_card):
    together = batched.generate(_mix())
    alone = [batched.generate([r])[0] for r in _mix()]
    tol = tiny_card.parity.tolerance("fp32", "component")
    assert batched.counters.batches > 0
    for a, b in zip(alone, together):
        assert a.ok and b.ok
        torch.testing.assert_close(b.latents, a.latents, atol=tol.atol, rtol=tol.rtol)


def test_padding_is_inert(batched):
    """Padding rows full of NaN never reach a result: same latents, bit for bit, as zero padding."""
    clean = batched.generate(_mix())
    batched.executor.runner.pad_value = float("nan")
    try:
        poisoned = batched.generate(_mix())
    finally:
        batched.executor.runner.pad_value = 0.0
    for a, b in zip(clean, poisoned):
        assert not torch.isnan(b.latents).any() and not torch.isnan(torch.from_numpy(b.frames).float()).any()
        assert torch.equal(a.latents, b.latents)
    # The poison did reach the batch: the last row (3 requests in a bucket of 4) of every per-step
    # input buffer held NaN when the step ran, though it held zero padding from the clean run.
    [entry] = batched.executor.runner._graphs.values()
    assert all(torch.isnan(buffer[-1]).all() for name, buffer in entry.per_step if buffer.is_floating_point())


def test_an_input_passed_through_comes_back_as_the_requests_own_tensor(batched):
    """UniPC's history shifts by one each step (carry_2 out is carry_1 in): the graph returns that
    input buffer, and each request gets back the tensor it passed in rather than a copy of its row."""
    passed = []

    def on_result(state, plan, result):
        if plan.kind == "denoise_cfg":
            passed.append(result["carry_2"] is plan.inputs["carry_1"])

    assert all(r.ok for r in batched.generate(_mix(), on_result=on_result))
    assert passed and all(passed)


def test_requests_of_one_shape_share_one_signature_object(batched):
    """Plans are grouped (and graphs found) by signature at every step: equal signatures are one
    object, so those lookups match by identity."""
    states = [batched.start(r) for r in _mix()]
    for state in states:
        state.phase = "denoise"  # embeddings are not needed to plan a step
        state.prompt_embeds = state.negative_prompt_embeds = torch.zeros(1, 32, 32)
    first, second, third = (batched.loop.next(s).signature for s in states)
    assert first is second is third


def test_no_recompiles_while_serving(batched):
    batched.warmup(_mix()[:1])
    with batched.counters.expect(compiles=0):
        results = batched.generate(_mix() + [Request(prompt="late", seed=7, guidance_scale=3.3, num_inference_steps=2, num_frames=5)])
    assert all(r.ok for r in results)
    batched.compiler.frozen = False


def test_cancel_mid_run_leaves_the_others_unchanged(tiny_engine):
    requests = _mix()
    victim = requests[1].request_id
    reference = tiny_engine.generate([requests[0], requests[2]])

    def cancel_after_two_steps(state, kind):
        if state.request_id == victim and state.step_index == 2:
            tiny_engine.cancel(victim)

    results = tiny_engine.generate(requests, on_step=cancel_after_two_steps)
    assert [r.status for r in results] == ["ok", "cancelled", "ok"]
    assert results[1].latents is None
    assert torch.equal(results[0].latents, reference[0].latents)
    assert torch.equal(results[2].latents, reference[1].latents)


def test_shape_without_a_bucket_falls_back_and_completes(tiny_engine):
    buckets = BucketSpec(batch_sizes=(1, 2), shapes=((5, 64, 64),))
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=AOT, buckets=buckets)
    odd = Request(prompt="wide", seed=5, num_inference_steps=3, num_frames=5, width=96)
    with engine.counters.expect(fallbacks=3, compiles=0):
        [result] = engine.generate([odd])
    assert result.ok
    assert torch.equal(result.latents, tiny_engine.generate([odd])[0].latents)


def test_fifo_admission_with_running_first(tiny_card):
    engine = Engine.from_card("tiny-wan", device="cpu", max_running=2)
    requests = [Request(prompt=f"r{i}", seed=i, num_inference_steps=2, num_frames=1, guidance_scale=1.0) for i in range(4)]
    seen = []
    engine.generate(requests, on_step=lambda state, kind: seen.append(state.request_id))
    ids = [r.request_id for r in requests]
    first_third = seen.index(ids[2])
    assert set(seen[:first_third]) == {ids[0], ids[1]}  # the third waits until a slot frees
    assert seen.index(ids[3]) > first_third


def test_scheduler_groups_by_signature_and_splits_at_the_largest_bucket(tiny_engine):
    from fvgraph.runtime.scheduler import Scheduler

    scheduler = Scheduler(tiny_engine.loop, BucketSpec(batch_sizes=(1, 2, 4)), max_running=16)
    shapes = [64] * 6 + [96] * 3  # two signatures
    for i, width in enumerate(shapes):
        request = Request(prompt_embeds=torch.zeros(4, 32), guidance_scale=1.0, seed=i, width=width, num_frames=1)
        scheduler.submit(tiny_engine.start(request))  # no text to encode: the first step is a denoise
    tick = scheduler.tick()
    assert [(len(g.members), g.lane) for g in tick.groups] == [(4, 0), (2, 1), (3, 0)]
    assert all(len({plan.signature for _, plan in g.members}) == 1 for g in tick.groups)


def test_bucket_spec_rules():
    spec = BucketSpec(batch_sizes=(1, 2, 4, 8))
    assert [spec.batch_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert spec.chunks(19) == [8, 8, 3]
    with pytest.raises(ValueError, match="ascending"):
        BucketSpec(batch_sizes=(4, 2))


def test_warmup_prepares_every_bucket_largest_first():
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=AOT, buckets=BucketSpec(batch_sizes=(1, 2, 4)))
    engine.warmup([Request(prompt="warm", seed=0, num_inference_steps=2, num_frames=5)])
    assert [s.batch for s in engine.compiler.signatures] == [4, 2, 1]
    with engine.counters.expect(compiles=0):
        results = engine.generate(_mix())
    assert all(r.ok for r in results)


def test_a_leaving_request_hands_its_row_to_the_last_one_and_the_rest_stay(batched):
    """Rows are stable: hoisted values are only copied for rows whose request changed."""
    from fvgraph.runtime.scheduler import Scheduler

    scheduler = Scheduler(batched.loop, batched.buckets, max_running=8)
    states = [batched.start(Request(prompt=f"p{i}", seed=i, num_frames=5)) for i in range(5)]
    scheduler.running = list(states)
    scheduler.remove([states[1]])
    assert scheduler.running == [states[0], states[4], states[2], states[3]]
    scheduler.remove([states[0], states[3]])  # the last one leaving too
    assert scheduler.running == [states[2], states[4]]
    scheduler.remove([states[4], states[2]])
    assert scheduler.running == []


def test_rows_whose_request_stayed_are_not_refilled(batched, monkeypatch):
    """Hoisted values are copied into a row only when the row changes hands: 3 arrivals, then the
    last request moving into each of the two rows that requests leave (the _mix steps 4, 3, 5); and
    the texts only the prologue reads are written once per arrival, for its prologue."""
    runner = batched.executor.runner
    inside, copies = {"on": False}, {"n": 0}
    fill, original = runner._fill_hoisted, torch.Tensor.copy_

    def counting_fill(*args):
        inside["on"] = True
        try:
            return fill(*args)
        finally:
            inside["on"] = False

    def counting_copy(self, src, *args, **kwargs):
        copies["n"] += inside["on"]
        return original(self, src, *args, **kwargs)

    monkeypatch.setattr(runner, "_fill_hoisted", counting_fill)
    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    with batched.counters.expect(hoisted_rows_copied=3 + 1 + 1):
        assert all(r.ok for r in batched.generate(_mix()))
    [entry] = [e for e in runner._graphs.values() if e.compiled.prologue_fn is not None]
    assert copies["n"] == (3 + 1 + 1) * len(entry.hoisted) + 3 * len(entry.prologue_constants)
    assert len(entry.prologue_constants) == 2  # the texts of both CFG branches


class _CountdownLoop:
    """A loop stub for the scheduler alone: each state runs `steps` one-row steps, then is Done; a
    state with steps < 0 fails when asked."""

    def next(self, state):
        if state.steps < 0:
            raise RuntimeError(f"{state.request_id} cannot plan")
        return Done() if state.steps == 0 else WorkPlan(state.request_id, "denoise", {"latents": torch.zeros(1, 2)})


def test_a_leaving_requests_place_goes_to_the_next_waiting_one_in_the_same_tick():
    """Its batch row changes hands once (no move of the last request, then the arrival appended), and
    an arrival that fails or is done at once passes the place on."""
    from types import SimpleNamespace

    from fvgraph.runtime.scheduler import Scheduler

    scheduler = Scheduler(_CountdownLoop(), BucketSpec(batch_sizes=(4,)), max_running=3)
    states = {name: SimpleNamespace(request_id=name, steps=steps)
              for name, steps in [("a", 1), ("b", 2), ("c", 3), ("d", 2), ("bad", -1), ("e", 0), ("f", 2)]}  # fmt: skip
    for state in states.values():
        scheduler.submit(state)

    def rows(tick):
        [group] = tick.groups
        for state, _ in group.members:
            state.steps -= 1  # the step ran
        return [state.request_id for state, _ in group.members]

    assert rows(scheduler.tick()) == ["a", "b", "c"]
    tick = scheduler.tick()  # a is done: d takes its row
    assert [s.request_id for s in tick.finished] == ["a"] and rows(tick) == ["d", "b", "c"]
    tick = scheduler.tick()  # b is done: "bad" fails and "e" is done when asked, so f takes b's row
    assert [s.request_id for s, _ in tick.failed] == ["bad"]
    assert [s.request_id for s in tick.finished] == ["b", "e"] and rows(tick) == ["d", "f", "c"]
    tick = scheduler.tick()  # d and c are done, nobody waits: f stays, the row after it is free
    assert rows(tick) == ["f"] and not tick.waiting
