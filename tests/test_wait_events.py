"""A served engine's compile is told to the requests that wait on it: `wait` events as it begins and
ends, before their first step; another engine's compile in the same process is not theirs."""

from __future__ import annotations

import asyncio
import logging

from fvgraph.compile.compiler import CompileConfig
from fvgraph.contract.progress import PROGRESS_LOGGER, progress_span
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.serving.async_engine import AsyncEngine


def test_a_compile_is_a_wait_event_of_the_requests_in_the_engine():
    engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", compile_config=CompileConfig(backend="eager"))
    request = Request(prompt="a fox", seed=0, num_inference_steps=2, num_frames=1, height=32, width=32, request_id="fox")

    async def main():
        async with AsyncEngine(engine) as served:
            with progress_span("compiling", "elsewhere"):  # this thread's, not the engine thread's
                pass
            return [event async for event in served.stream(request)]

    events = asyncio.run(main())
    waits = [e for e in events if e.kind == "wait"]
    assert [e.activity for e in waits] == ["compiling denoise_cfg, batch bucket 1"] * 2
    assert waits[0].wait_seconds is None and waits[1].wait_seconds > 0
    assert waits[0].to_json() == {"request_id": "fox", "event": "wait", "activity": "compiling denoise_cfg, batch bucket 1"}
    first_denoise = next(i for i, e in enumerate(events) if e.kind == "step" and e.step is not None)
    assert events.index(waits[1]) < first_denoise  # told before the denoise step that waited on it
    assert not logging.getLogger(PROGRESS_LOGGER).handlers  # the relay left with its engine
