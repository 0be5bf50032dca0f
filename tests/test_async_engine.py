"""AsyncEngine: the engine ticks on its own thread; asyncio callers generate, stream and cancel."""

import asyncio
import time

import pytest
import torch

from fvgraph.serving.admission import Admission, QueueFull
from fvgraph.serving.async_engine import AsyncEngine, EngineClosed
from fvgraph.serving.memory_reservation import MemoryModel
from fvgraph.request import Request, RequestRejected


def _request(name: str, seed: int = 0, steps: int = 3, **extra) -> Request:
    fields = {"num_frames": 1, "height": 32, "width": 32, "guidance_scale": 4.0, **extra}
    return Request(prompt=name, seed=seed, num_inference_steps=steps, request_id=name, **fields)


def _served(engine, budget_requests: float | None = None, max_queue: int = 64, **request_fields) -> AsyncEngine:
    """An AsyncEngine whose memory budget holds `budget_requests` requests shaped like _request(...)."""
    admission = None
    if budget_requests is not None:
        model = MemoryModel(engine)
        one = model.estimate(_request("probe", **request_fields).resolve(engine.card)).total
        admission = Admission(model, int(one * budget_requests), max_queue, engine.max_running)
    return AsyncEngine(engine, admission, max_queue=max_queue)


def _inject(monkeypatch, engine, slow: str = "", broken: str = "") -> None:
    """Steps of request `slow` take 50 ms more; step 1 of request `broken` raises."""
    run_batch = engine.executor.run_batch

    def run(plans, slots, lane=0):
        ids = {plan.request_id for plan in plans}
        if slow in ids:
            time.sleep(0.05)
        if any(plan.request_id == broken and plan.step_index == 1 for plan in plans):
            raise RuntimeError("injected step failure")
        return run_batch(plans, slots, lane)

    monkeypatch.setattr(engine.executor, "run_batch", run)


def test_generate_matches_the_engine_and_stream_reports_every_step(tiny_engine):
    solo = tiny_engine.generate([_request("solo", seed=3)])[0]

    async def main():
        async with _served(tiny_engine) as served:
            result = await served.generate(_request("solo", seed=3))
            events = [event async for event in served.stream(_request("streamed", seed=4, steps=4))]
            return result, events

    result, events = asyncio.run(main())
    assert result.ok and torch.equal(result.latents, solo.latents)
    kinds = [e.kind for e in events]
    assert kinds[:2] == ["queued", "started"] and kinds[-1] == "done" and kinds.count("done") == 1
    denoise = [e for e in events if e.step is not None]
    assert [(e.step, e.total) for e in denoise] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert all(e.step_seconds > 0 and e.batch == 1 for e in denoise)
    assert denoise[-1].to_json()["progress"] == 100.0
    assert events[-1].result.frames.shape == (1, 32, 32, 3)


def test_a_subscriber_that_comes_after_the_first_steps_gets_them_first(tiny_engine, monkeypatch):
    _inject(monkeypatch, tiny_engine, slow="late")  # 50 ms a step: the subscriber comes between two

    async def main():
        async with _served(tiny_engine) as served:
            two_done = asyncio.Event()
            served.listeners.append(lambda e: e.step == 2 and two_done.set())
            served.submit(_request("late", steps=5))
            await asyncio.wait_for(two_done.wait(), 30)
            events = served.subscribe("late")
            seen = []
            while not seen or not seen[-1].terminal:
                seen.append(await asyncio.wait_for(events.get(), 30))
            return seen

    kinds = [(e.kind, e.step) for e in asyncio.run(main())]
    assert kinds[:2] == [("queued", None), ("started", None)] and kinds[-1] == ("done", None)
    assert [step for kind, step in kinds if kind == "step" and step is not None] == [1, 2, 3, 4, 5]  # each once, in order


def test_cancel_timeout_and_an_injected_step_failure_end_only_their_request(tiny_engine, monkeypatch):
    _inject(monkeypatch, tiny_engine, slow="late", broken="broken")

    async def main():
        async with _served(tiny_engine) as served:
            victim = served.stream(_request("victim", steps=20))
            async for event in victim:
                if event.kind == "step" and event.step == 2:
                    assert await served.cancel("victim")
                if event.terminal:
                    cancelled = event
            results = await asyncio.gather(
                served.generate(_request("fine", seed=1)),
                served.generate(_request("broken", seed=2)),
                served.generate(_request("late", seed=3, steps=50), timeout_s=0.3),
            )
            assert not await served.cancel("victim")  # ended: a stale cancel changes nothing
            return cancelled, results, served.admission.reserved_bytes

    cancelled, (fine, broken, late), reserved = asyncio.run(main())
    assert cancelled.kind == "cancelled" and cancelled.reason == "client"
    assert fine.ok
    assert broken.status == "failed" and "injected step failure" in broken.error
    assert late.status == "cancelled"
    assert reserved == 0


def test_admission_holds_requests_until_memory_frees_and_refuses_what_never_fits(tiny_engine):
    async def main():
        served = _served(tiny_engine, budget_requests=2.5, max_queue=4)
        peak = []
        served.listeners.append(lambda event: peak.append(served.admission.reserved_bytes))
        await served.start()
        try:
            with pytest.raises(RequestRejected, match="memory_budget: .* more than the whole budget"):
                served.submit(_request("huge", num_frames=33, height=256, width=256))
            tasks = [asyncio.ensure_future(served.generate(_request(f"r{i}", seed=i))) for i in range(4)]
            await asyncio.sleep(0)
            with pytest.raises(QueueFull, match="queue is full"):
                served.submit(_request("one-too-many"))
            results = await asyncio.gather(*tasks)
            return results, peak, served.admission
        finally:
            await served.close()

    results, peak, admission = asyncio.run(main())
    assert all(r.ok for r in results)
    assert max(peak) <= admission.budget and max(peak) > admission.budget / 2.5  # two ran at once, never three
    assert admission.reserved_bytes == 0 and admission.queue_depth == 0


def test_drain_lets_requests_finish_then_cancels_the_rest_and_refuses_new_ones(tiny_engine, monkeypatch):
    _inject(monkeypatch, tiny_engine, slow="slow")

    async def main():
        served = _served(tiny_engine)
        await served.start()
        quick = asyncio.ensure_future(served.generate(_request("quick", steps=2)))
        slow = asyncio.ensure_future(served.generate(_request("slow", steps=50)))
        await asyncio.sleep(0.05)
        await served.drain(timeout_s=0.5)
        with pytest.raises(EngineClosed, match="shutting down"):
            served.submit(_request("after"))
        await served.close()
        return await quick, await slow

    quick, slow = asyncio.run(main())
    assert quick.ok and slow.status == "cancelled" and slow.timings["total"] >= 0.5
