"""The HTTP API through the official openai client against a live server on 127.0.0.1."""

import asyncio
import base64
import io
import json

import numpy as np
import pytest
from http_helpers import httpx, openai, KEY, QUICK, client, expected_video, live_server, slow_steps, wait_for
from PIL import Image

from fvgraph.engine.engine import Engine
from fvgraph.serving.http_app import HttpSettings
from fvgraph.serving.http_server import HttpServer
from fvgraph.serving.media_encode import decode_mp4
from fvgraph.serving.request_events import RequestEvent
from fvgraph.serving.video_store import StoredVideo

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    with live_server(tiny_engine, tmp_path_factory.mktemp("http"), max_body_bytes=12 << 20) as (srv, url):
        yield srv, url


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_create_and_poll_completes_and_the_content_is_the_requested_video(server):
    srv, url = server
    api = client(url)
    video = api.videos.create_and_poll(prompt="a fox", size="32x32", seconds="1", poll_interval_ms=20, extra_body=QUICK)
    assert video.status == "completed" and video.progress == 100 and video.model == "tiny-wan"
    assert video.id.startswith("video_") and video.seconds == "1.25" and video.size == "32x32"  # 5 frames at 4 fps
    assert video.completed_at >= video.created_at and video.expires_at > video.completed_at

    frames = decode_mp4(api.videos.download_content(video.id).read())
    assert frames.shape == (5, 32, 32, 3)  # 1 s at 4 fps -> 4 frames -> the nearest 4k+1 is 5
    direct = Engine.from_card("tiny-wan", device="cpu")  # the server's engine is busy in its own thread
    assert np.array_equal(frames, expected_video(direct, fps=4, prompt="a fox", height=32, width=32, num_frames=5,
                                                 num_inference_steps=2, seed=1))  # fmt: skip
    other = api.videos.create_and_poll(prompt="a fox", size="32x32", seconds="1", poll_interval_ms=20, extra_body={**QUICK, "seed": 2})
    assert not np.array_equal(decode_mp4(api.videos.download_content(other.id).read()), frames)  # the seed shows
    thumbnail = Image.open(io.BytesIO(api.videos.download_content(video.id, variant="thumbnail").read()))
    assert thumbnail.format == "JPEG" and thumbnail.size == (32, 32)
    assert not list(srv.store.root.glob("*.partial"))


def test_deleting_a_running_video_cancels_it_and_frees_its_reservation(server, tiny_engine, monkeypatch):
    srv, url = server
    slow_steps(monkeypatch, tiny_engine)
    api = client(url)
    cancelled_before = _metric(url, 'fvgraph_cancellations_total{reason="client"}')
    video = api.videos.create(prompt="a long one", size="32x32", extra_body={**QUICK, "num_inference_steps": 40})
    wait_for(lambda: api.videos.retrieve(video.id).progress > 0, what="the video to make progress")

    deleted = api.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError, match="no video"):
        api.videos.retrieve(video.id)
    wait_for(lambda: _metric(url, 'fvgraph_cancellations_total{reason="client"}') == cancelled_before + 1,
             what="the cancellation")  # fmt: skip
    assert srv.served.admission.reserved_bytes == 0
    assert not list(srv.store.root.glob(f"{video.id}*"))


def test_a_step_that_raises_fails_only_its_video(server, tiny_engine, monkeypatch):
    _, url = server
    broken: set[str] = set()
    run_batch = tiny_engine.executor.run_batch

    def run(plans, slots, lane=0):
        if any(plan.request_id in broken and plan.step_index >= 2 for plan in plans):
            raise RuntimeError("injected step failure")
        return run_batch(plans, slots, lane)

    monkeypatch.setattr(tiny_engine.executor, "run_batch", run)
    slow_steps(monkeypatch, tiny_engine, 0.02)
    api = client(url)
    victim = api.videos.create(prompt="victim", size="32x32", extra_body={**QUICK, "num_inference_steps": 20})
    broken.add(victim.id)
    neighbour = api.videos.create(prompt="neighbour", size="32x32", extra_body={**QUICK, "num_inference_steps": 6})
    failed = api.videos.poll(victim.id, poll_interval_ms=20)
    assert failed.status == "failed" and failed.error.code == "generation_failed"
    assert "injected step failure" in failed.error.message
    assert api.videos.poll(neighbour.id, poll_interval_ms=20).status == "completed"
    with pytest.raises(openai.NotFoundError, match="is failed"):
        api.videos.download_content(victim.id)


def test_list_pages_newest_first(server):
    _, url = server
    api = client(url)
    made = [api.videos.create(prompt=f"page {i}", size="32x32", extra_body={**QUICK, "num_frames": 1}).id for i in range(3)]
    first = api.videos.list(limit=2)
    assert [v.id for v in first.data] == made[::-1][:2] and first.has_more
    second = api.videos.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    everything = [v.id for v in api.videos.list(limit=2)]  # the SDK follows the pages itself
    assert everything[:3] == made[::-1] and len(everything) == len(set(everything))
    oldest_first = [v.id for v in api.videos.list(order="asc", limit=100)]
    assert oldest_first == everything[::-1]


def test_images_generate_returns_a_png_as_b64_or_url(server):
    _, url = server
    api = client(url)
    image = api.images.generate(prompt="a fox", size="48x32", extra_body={"num_inference_steps": 2, "seed": 3})
    png = Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json)))
    assert png.format == "PNG" and png.size == (48, 32)

    two = api.images.generate(prompt="a fox", size="32x32", n=2, response_format="url", extra_body={"num_inference_steps": 2})
    for item in two.data:
        fetched = httpx.get(item.url, headers={"Authorization": f"Bearer {KEY}"})
        assert fetched.status_code == 200 and Image.open(io.BytesIO(fetched.content)).size == (32, 32)


def test_a_wrong_or_missing_key_gets_401_and_health_stays_open(server):
    _, url = server
    with pytest.raises(openai.AuthenticationError, match="API key"):
        client(url, key="wrong").videos.list()
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").images.generate(prompt="x")
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/ready").json()["ready"] is True


def _events(url: str, video_id: str, stop_after: int | None = None) -> list[tuple[str, dict]]:
    """Read the SSE stream; with `stop_after`, hang up after that many events."""
    events = []
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", headers=headers, timeout=30) as response:
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                if stop_after is not None and len(events) >= stop_after:
                    break
    return events


def test_events_stream_each_step_and_a_client_hanging_up_mid_stream_harms_nothing(server, tiny_engine, monkeypatch):
    _, url = server
    slow_steps(monkeypatch, tiny_engine, 0.02)
    api = client(url)
    dropped = api.videos.create(prompt="hang up", size="32x32", extra_body={**QUICK, "num_inference_steps": 6})
    assert len(_events(url, dropped.id, stop_after=3)) == 3  # the client goes away mid-run

    watched = api.videos.create(prompt="watched", size="32x32", extra_body={**QUICK, "num_inference_steps": 4})
    events = _events(url, watched.id)
    steps = [body for kind, body in events if kind == "step" and "total" in body]
    assert [(s["step"], s["total"], s["progress"]) for s in steps] == [(1, 4, 25.0), (2, 4, 50.0), (3, 4, 75.0), (4, 4, 100.0)]
    assert all(s["step_seconds"] > 0 and s["step_kind"] == "denoise_cfg" for s in steps)
    assert [kind for kind, _ in events][-2:] == ["done", "video"] and events[-1][1]["status"] == "completed"

    assert wait_for(lambda: api.videos.retrieve(dropped.id).status == "completed", what="the abandoned stream's video")
    assert httpx.get(url + "/health").status_code == 200


def test_the_events_stream_sends_the_end_that_arrived_with_the_last_step(tiny_engine, tmp_path):
    """The last step and the end can be delivered in one batch, which also makes the request unknown to
    the engine: the stream still sends the end (with its timings) before the final Video."""
    srv = HttpServer(tiny_engine, HttpSettings(), tmp_path, port=0)  # not started: the stream is driven by hand
    api, video_id = srv.app.state.api, "video_" + "0" * 32
    srv.store.add(StoredVideo(video_id, "video", "tiny-wan", "p", "32x32", "1", 1, 4.0, 0, status="in_progress"))
    events = srv.served.subscribe(video_id)
    for event in (RequestEvent(video_id, "step", step=1, total=1), RequestEvent(video_id, "done")):
        events.put_nowait(event)
    assert not srv.served.knows(video_id)

    async def read() -> list[str]:
        stream = api._event_stream(video_id, events)
        kinds = [await anext(stream), await anext(stream)]
        srv.store.finish(video_id, "failed", {"code": "test", "message": "ended"})  # what the encode would do
        return [chunk.split("\n")[0] for chunk in kinds + [chunk async for chunk in stream]]

    assert asyncio.run(asyncio.wait_for(read(), 10)) == ["event: video", "event: step", "event: done", "event: video"]


MALFORMED = [
    ({"content": b"{not json", "headers": {"Content-Type": "application/json"}}, "body", "not valid JSON"),
    ({"content": b"prompt=x", "headers": {"Content-Type": "text/plain"}}, "body", "must be multipart/form-data or application/json"),
    ({"json": {"prompt": "x", "colour": "red"}}, "colour", "unknown field"),
    ({"data": {"prompt": "x", "size": "32by32"}}, "size", "must be WIDTHxHEIGHT"),
    ({"data": {"prompt": "x", "num_frames": "0"}}, "num_frames", "greater than or equal to 1"),
    ({"data": {"prompt": "x", "num_inference_steps": "0"}}, "num_inference_steps", "greater than or equal to 1"),
    ({"data": {"prompt": "x", "size": "40x32"}}, "size", "width=40 must be a multiple of 16"),
    ({"data": {"prompt": "x", "model": "sora-2"}}, "model", "not served here"),
    ({"data": {"prompt": "x" * (10 << 20)}}, "prompt", "exceed the limit"),
    ({"data": {"prompt": "x"}, "files": {"input_reference": ("ref.png", b"not an image", "image/png")}}, "input_reference", "takes no image"),  # checked before the upload is opened
    ({"json": {"prompt": "x", "input_reference": {"image_url": "http://169.254.169.254/"}}}, "input_reference", "fetches no URLs"),
]  # fmt: skip


def test_malformed_bodies_get_400_naming_the_field_and_rule_while_others_are_served(server):
    srv, url = server
    api = client(url)
    bystander = api.videos.create(prompt="bystander", size="32x32", extra_body=QUICK)
    headers = {"Authorization": f"Bearer {KEY}"}
    before = len(srv.store)
    for request, field, rule in MALFORMED:
        extra = request.pop("headers", {})
        response = httpx.post(url + "/v1/videos", headers={**headers, **extra}, timeout=30, **request)
        error = response.json()["error"]
        assert response.status_code == 400, (field, error)
        assert error["param"] == field and rule in error["message"], (field, error)
    reference = io.BytesIO()
    Image.new("RGB", (32, 32)).save(reference, format="PNG")
    with pytest.raises(openai.BadRequestError, match="input_reference: card 'tiny-wan' generates from text only"):
        api.videos.create(prompt="x", input_reference=("ref.png", reference.getvalue(), "image/png"))
    too_big = httpx.post(url + "/v1/videos", headers=headers, data={"prompt": "x" * (13 << 20)}, timeout=30)
    assert too_big.status_code == 413 and "--max-body-bytes" in too_big.json()["error"]["message"]
    chunks = (b" " * (1 << 20) for _ in range(13))  # no Content-Length: the limit holds as the bytes arrive
    streamed = httpx.post(url + "/v1/videos", headers={**headers, "Content-Type": "application/json"}, content=chunks, timeout=30)
    assert streamed.status_code == 413 and streamed.json()["error"]["param"] == "body"
    assert len(srv.store) == before  # nothing refused left a record
    assert api.videos.poll(bystander.id, poll_interval_ms=20).status == "completed"


def test_an_image_to_video_card_takes_input_reference_as_its_first_frame(tmp_path):
    """input_reference reaches Request(image=...): the same image gives the same video, another image another."""
    from fvgraph.engine.engine import Engine

    engine = Engine.from_card("tiny-wan-i2v", device="cpu")

    def png(color) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (40, 24), color).save(buffer, format="PNG")
        return buffer.getvalue()

    with live_server(engine, tmp_path) as (_, url):
        api = client(url)

        def video(image: bytes):
            made = api.videos.create_and_poll(prompt="a fox", size="32x32", seconds="1", poll_interval_ms=20,
                                              input_reference=("ref.png", image, "image/png"), extra_body=QUICK)  # fmt: skip
            assert made.status == "completed", made.error
            return decode_mp4(api.videos.download_content(made.id).read())

        red, same, blue = video(png((220, 30, 30))), video(png((220, 30, 30))), video(png((30, 30, 220)))
    assert red.shape == (5, 32, 32, 3)
    assert (red == same).all() and not (red == blue).all()
