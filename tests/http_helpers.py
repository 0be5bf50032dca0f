"""Shared by the HTTP tests: a live server on 127.0.0.1 and the official openai client pointed at it."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

openai = pytest.importorskip("openai")  # the test extra; a GPU machine without it skips the HTTP tests
try:  # the HTTP client openai itself uses: httpx2 in its 3.x releases, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx

from fvgraph.request import Request
from fvgraph.serving.http_app import HttpSettings
from fvgraph.serving.http_server import HttpServer
from fvgraph.serving.media_encode import decode_mp4, encode_mp4
from fvgraph.serving.openai_requests import DEFAULT_FPS

KEY = "test-key"
# Small and quick on a CPU: one 32x32 frame or five, a few steps.
QUICK = {"num_inference_steps": 2, "fps": 4, "seed": 1}


@contextlib.contextmanager
def live_server(engine, tmp_path, **settings):
    """Yields (server, base_url) for an HttpServer on an ephemeral port; stops it afterwards."""
    limits = {k: settings.pop(k) for k in ("max_queue", "memory_budget") if k in settings}
    server = HttpServer(engine, HttpSettings(api_key=KEY, **settings), tmp_path / "store", port=0, **limits)
    with server.running() as url:
        yield server, url


def expected_video(engine, fps: float = DEFAULT_FPS, **fields):
    """What a served video of `fields` must decode to: the engine run directly on Request(**fields),
    through the same H.264 encode (deterministic: one input, one bitstream; fvgraph/serving/media_encode.py)."""
    [result] = engine.generate([Request(**fields)])
    assert result.ok, result.error
    return decode_mp4(encode_mp4(result.frames, fps))


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=url + "/v1", max_retries=0)


def slow_steps(monkeypatch, engine, seconds: float = 0.05, only: set[str] | None = None) -> None:
    """Every denoise step of the engine (of the requests in `only`, when given; the set may be filled
    later) takes `seconds` longer, so a test can act while one runs."""
    run_batch = engine.executor.run_batch

    def run(plans, slots, lane=0):
        chosen = only is None or any(plan.request_id in only for plan in plans)
        if chosen and plans[0].kind.startswith("denoise"):
            time.sleep(seconds)
        return run_batch(plans, slots, lane)

    monkeypatch.setattr(engine.executor, "run_batch", run)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def sse_events(url: str, video_id: str, timeout_s: float = 60.0) -> list[tuple[str, dict]]:
    """(event name, data) of each event a video's `/events` stream sends, until it ends."""
    events, kind = [], None
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", headers=headers, timeout=timeout_s) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
    return events
