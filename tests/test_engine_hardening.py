"""The engine under API misuse: stale cancels, raising callbacks, garbage numbers, tampered saved states."""

from __future__ import annotations


import pytest
import torch
from pydantic import ValidationError

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.loops.t2v_loop import T2VState

TINY = dict(prompt="a fox", num_inference_steps=2, height=16, width=16, num_frames=1, output_type="latent", seed=4)


def test_a_cancel_after_the_request_ended_is_refused_and_never_reaches_a_later_one(tiny_engine):
    tiny_engine.submit(Request(**{**TINY, "num_inference_steps": 1}, request_id="early"))
    tiny_engine.generate([Request(**{**TINY, "num_inference_steps": 4}, request_id="other")])  # "early" ends meanwhile
    assert tiny_engine.cancel("early") is False  # ended: its result only waits to be handed back
    [waiting] = tiny_engine.tick()
    assert (waiting.request_id, waiting.status) == ("early", "ok")

    calls = []

    def cancel_the_short_one(state, kind):
        # tick 1 encodes both, tick 2 runs early's only step, tick 3 finalizes it and runs long's step 1
        if state.request_id == "long" and state.step_index == 2:
            calls.append(tiny_engine.cancel("early"))

    first, long = tiny_engine.generate([Request(**{**TINY, "num_inference_steps": 1}, request_id="early"),
                                        Request(**{**TINY, "num_inference_steps": 4}, request_id="long")],
                                       on_step=cancel_the_short_one)  # fmt: skip
    assert first.ok and long.ok and calls == [False]
    [again] = tiny_engine.generate([Request(**TINY, request_id="early")])
    assert again.status == "ok" and not tiny_engine.has_work()


@pytest.mark.parametrize("callback", ["on_step", "on_result"])
def test_a_raising_callback_leaves_nothing_in_flight(tiny_engine, callback):
    def boom(*args):
        raise RuntimeError("the caller's callback failed")

    requests = [Request(**TINY, request_id="cb1"), Request(**TINY, request_id="cb2")]
    with pytest.raises(RuntimeError, match="callback failed"):
        tiny_engine.generate(requests, **{callback: boom})
    assert not tiny_engine.has_work() and tiny_engine.tick() == []
    assert [r.status for r in tiny_engine.generate(requests)] == ["ok", "ok"]  # the ids are free again


def test_a_step_with_non_finite_outputs_fails_its_request_naming_the_step(tiny_engine, tiny_card):
    huge = torch.full((4, tiny_card.components["transformer"].config["text_dim"]), 3e38)  # finite, but overflows inside the model
    bad, good = tiny_engine.generate([Request(**{**TINY, "prompt": None}, prompt_embeds=huge, request_id="huge"),
                                      Request(**TINY, request_id="fine")])  # fmt: skip
    assert bad.status == "failed" and "denoise" in bad.error and "not finite" in bad.error
    assert good.status == "ok" and torch.isfinite(good.latents).all()


def _mid_run_state(engine) -> T2VState:
    state = engine.start(Request(**{**TINY, "num_inference_steps": 3}))
    engine.step(state)  # text encode
    engine.step(state)  # denoise step 0
    return state


TAMPERINGS = {
    "latents": lambda s: setattr(s, "latents", torch.full_like(s.latents, float("nan"))),
    "latents ": lambda s: setattr(s, "latents", s.latents.to(torch.int64)),
    "step_index": lambda s: setattr(s, "step_index", -1),
    "step_index ": lambda s: setattr(s, "step_index", 7),
    "phase": lambda s: setattr(s, "phase", "sideways"),
    "weights_version": lambda s: setattr(s, "weights_version", "other-weights"),
    "weights_version ": lambda s: setattr(s, "weights_version", ""),
    "carry": lambda s: setattr(s, "carry", []),
    "prompt_embeds": lambda s: setattr(s, "prompt_embeds", s.prompt_embeds[:, :3]),
    "timesteps": lambda s: setattr(s, "timesteps", torch.full(s.timesteps.shape, float("nan"))),
    "coeffs": lambda s: setattr(s, "coeffs", s.coeffs[:1]),
}


@pytest.mark.parametrize("field", sorted(TAMPERINGS))
def test_a_tampered_state_is_refused_on_resume_naming_the_field(tiny_engine, field):
    state = _mid_run_state(tiny_engine)
    TAMPERINGS[field](state)
    with pytest.raises(ValueError, match=field.strip()):
        tiny_engine.resume(state)


def test_an_untampered_state_resumes(tiny_engine, tmp_path):
    state = _mid_run_state(tiny_engine)
    state.save(tmp_path / "s.pt")
    assert tiny_engine.finish(tiny_engine.resume(T2VState.load(tmp_path / "s.pt"))).ok


def test_an_unreadable_saved_state_names_the_file(tiny_engine, tmp_path):
    state = _mid_run_state(tiny_engine)
    state.save(tmp_path / "s.pt")
    data = (tmp_path / "s.pt").read_bytes()
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    for name in ("empty.pt", "cut.pt"):
        with pytest.raises(ValueError, match=f"{name}: not a readable saved state"):
            T2VState.load(tmp_path / name)
    fields = state.saved_fields()
    for broken, message in ((dict(fields, colour="red"), "unknown field colour"),
                            ({k: v for k, v in fields.items() if k != "latents"}, "missing field latents"),
                            (dict(fields, step_index="3"), "step_index must be an int")):  # fmt: skip
        torch.save({"type": "T2VState", "fields": broken}, tmp_path / "t.pt")
        with pytest.raises(ValueError, match=f"t.pt: .*{message}"):
            T2VState.load(tmp_path / "t.pt")


def test_meta_embeddings_and_boolean_numbers_are_validation_errors():
    with pytest.raises(ValidationError, match="prompt_embeds"):
        Request(prompt_embeds=torch.empty(4, 32, device="meta"))
    for field in ("num_inference_steps", "num_frames", "seed"):
        with pytest.raises(ValidationError, match=f"{field} must be a number, not a boolean"):
            Request(prompt="x", **{field: True})


def test_compiled_shapes_are_bounded_and_later_shapes_run_eagerly():
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="eager"),
                              buckets=BucketSpec(batch_sizes=(1,), max_shapes=1))  # fmt: skip
    shapes = [(16, 16), (16, 32), (32, 16)]
    results = engine.generate([Request(**{**TINY, "height": h, "width": w}, request_id=f"s{h}x{w}") for h, w in shapes])
    assert all(r.ok for r in results)
    assert len(engine.compiler.signatures) == 1 and engine.counters.fallbacks == 2 * TINY["num_inference_steps"]
    with pytest.raises(ValidationError, match="max_shapes"):
        BucketSpec(max_shapes=0)


def test_something_that_is_not_a_request_is_refused_by_type(tiny_engine):
    with pytest.raises(TypeError, match="fvgraph.Request objects, got dict"):
        tiny_engine.generate([{"prompt": "a fox"}])
    assert not tiny_engine.has_work()


@pytest.mark.parametrize(("callback", "call"), [
    ("on_step", lambda engine, state: engine.tick()),
    ("on_step", lambda engine, state: engine.generate([Request(**TINY, request_id="inner")])),
    ("on_step", lambda engine, state: engine.step(state)),
    ("on_result", lambda engine, state: engine.tick()),
])  # fmt: skip
def test_a_tick_from_inside_a_callback_is_refused_and_the_bystander_is_unharmed(tiny_engine, callback, call):
    [alone] = tiny_engine.generate([Request(**{**TINY, "num_inference_steps": 4}, request_id="bystander")])
    refusals = []

    def drive_from_inside(state, *rest):
        try:
            call(tiny_engine, state)
        except RuntimeError as err:
            refusals.append(str(err))

    tiny_engine.submit(Request(**{**TINY, "num_inference_steps": 4}, request_id="bystander"))
    [own] = tiny_engine.generate([Request(**TINY, request_id="caller")], **{callback: drive_from_inside})
    results = {r.request_id: r for r in [own, *tiny_engine.tick()]}
    while tiny_engine.has_work():
        results.update((r.request_id, r) for r in tiny_engine.tick())
    assert refusals and all("from inside a callback" in text for text in refusals)
    assert results["caller"].ok and results["bystander"].ok
    assert torch.equal(results["bystander"].latents, alone.latents)
    assert not tiny_engine.has_work()


@pytest.mark.parametrize("broken", [{"one"}, {"one", "two"}])  # one member of a group, or all of it
def test_a_step_whose_outputs_do_not_fold_back_fails_its_requests_and_the_tick_carries_on(tiny_engine, monkeypatch, broken):
    single = dict(TINY, guidance_scale=1.0, num_inference_steps=3)
    [alone] = tiny_engine.generate([Request(**single, request_id="fine")])
    advance = tiny_engine.loop.advance

    def advance_or_fail(state, result):
        if "latents" in result and state.request_id in broken:
            raise KeyError("latents")  # what a step whose output names are wrong runs into
        return advance(state, result)

    monkeypatch.setattr(tiny_engine.loop, "advance", advance_or_fail)
    for request_id in ("one", "two"):
        tiny_engine.submit(Request(**{**TINY, "guidance_scale": 5.0}, request_id=request_id))
    tiny_engine.submit(Request(**single, request_id="fine"))
    results = {}
    while tiny_engine.has_work():
        results.update((r.request_id, r) for r in tiny_engine.tick())  # never raises
    for request_id in ("one", "two"):
        if request_id in broken:
            assert results[request_id].status == "failed" and "latents" in results[request_id].error
        else:
            assert results[request_id].ok
    assert results["fine"].ok and torch.equal(results["fine"].latents, alone.latents)


@pytest.mark.parametrize("at_step", [0, 1])  # its first denoise step, or one after it ran a step
def test_a_loop_that_cannot_plan_a_step_fails_its_request_and_the_tick_carries_on(tiny_engine, monkeypatch, at_step):
    [alone] = tiny_engine.generate([Request(**TINY, request_id="fine")])
    plan_next = tiny_engine.loop.next

    def next_or_fail(state):
        if state.request_id == "broken" and state.phase == "denoise" and state.step_index == at_step:
            raise ValueError("a schedule the loop cannot step")
        return plan_next(state)

    monkeypatch.setattr(tiny_engine.loop, "next", next_or_fail)
    tiny_engine.submit(Request(**TINY, request_id="broken"))
    tiny_engine.submit(Request(**TINY, request_id="fine"))
    results = {}
    while tiny_engine.has_work():
        results.update((r.request_id, r) for r in tiny_engine.tick())  # never raises
    assert results["broken"].status == "failed" and "cannot step" in results["broken"].error
    assert results["fine"].ok and torch.equal(results["fine"].latents, alone.latents)
