"""Admission over HTTP: 400 for what never fits, 429 with Retry-After for a full queue, timeouts say so."""

import pytest
from http_helpers import httpx, openai, KEY, QUICK, client, live_server, slow_steps, wait_for

from fvgraph.serving.memory_reservation import MemoryModel
from fvgraph.request import Request

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SHAPE = {"size": "32x32", "extra_body": {**QUICK, "num_frames": 5, "num_inference_steps": 40}}


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if not line.startswith("#")}


def test_memory_budget_queue_limit_and_timeout(tiny_engine, tmp_path, monkeypatch):
    one = MemoryModel(tiny_engine).estimate(
        Request(prompt="x", num_frames=5, height=32, width=32, guidance_scale=5.0).resolve(tiny_engine.card)
    ).total
    slow_steps(monkeypatch, tiny_engine)
    with live_server(tiny_engine, tmp_path, memory_budget=int(2.5 * one), max_queue=2) as (srv, url):
        api = client(url)
        with pytest.raises(openai.BadRequestError, match="memory_budget: .*--memory-budget") as never:
            api.videos.create(prompt="too big", size="256x256", extra_body={"num_frames": 33})
        assert never.value.body["param"] == "memory_budget"

        running = [api.videos.create(prompt=f"run {i}", **SHAPE) for i in range(2)]
        wait_for(lambda: all(api.videos.retrieve(v.id).status == "in_progress" for v in running), what="two running")
        waiting = [api.videos.create(prompt=f"wait {i}", **SHAPE) for i in range(2)]
        with pytest.raises(openai.RateLimitError, match="queue is full") as full:
            api.videos.create(prompt="one too many", **SHAPE)
        assert int(full.value.response.headers["retry-after"]) >= 1
        assert srv.served.admission.reserved_bytes == 2 * one  # the waiting two reserve nothing yet
        assert api.videos.retrieve(waiting[0].id).status == "queued"

        for video in running:
            api.videos.delete(video.id)  # frees memory: the waiting ones start
        wait_for(lambda: api.videos.retrieve(waiting[0].id).status == "in_progress", what="a waiting video to start")
        timed = api.videos.create(prompt="deadline", size="32x32", extra_body={**QUICK, "num_inference_steps": 40, "timeout": 0.3})
        video = api.videos.poll(timed.id, poll_interval_ms=20)
        assert video.status == "failed" and video.error.code == "timeout" and "timeout" in video.error.message
        for video in waiting:
            api.videos.delete(video.id)
        wait_for(lambda: srv.served.in_flight == 0, what="every request to end")

        metrics = _metrics(url)
        assert metrics['fvgraph_rejections_total{reason="memory"}'] == 1
        assert metrics['fvgraph_rejections_total{reason="queue_full"}'] == 1
        assert metrics['fvgraph_cancellations_total{reason="timeout"}'] == 1
        assert metrics['fvgraph_cancellations_total{reason="client"}'] == 4
        assert metrics["fvgraph_memory_reserved_bytes"] == 0 and metrics["fvgraph_queue_depth"] == 0
        assert metrics['fvgraph_request_seconds_count{status="cancelled"}'] == 5
