"""What a browser and a media player need from the HTTP API, and the rest of OpenAI's videos API:
CORS, HEAD, faststart mp4s, ETags, pagination past a removed cursor, Retry-After from the queue's
measurements, OpenAI-shaped framework errors, remix and the spritesheet. Driven by the official
`openai` client where it can send the request, by httpx where it cannot."""

import asyncio
import io
import math
import struct
from collections import deque

import numpy as np
import pytest
from http_helpers import httpx, openai, KEY, QUICK, client, expected_video, live_server, slow_steps, wait_for
from PIL import Image

from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.serving.admission import Admission, QueueFull
from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.serving.http_app import HttpSettings, create_app
from fvgraph.serving.media_encode import decode_mp4, encode_spritesheet, sprite_grid
from fvgraph.serving.memory_reservation import MemoryModel
from fvgraph.serving.shared_video_store import SharedVideoStore
from fvgraph.media_file import write_video
from fvgraph.serving.video_store import StoredVideo, VideoStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated
ORIGIN = "http://app.example:3000"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIVE = {**QUICK, "num_frames": 5}  # 5 frames of 32x32, 2 steps: about a second on a CPU


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    with live_server(tiny_engine, tmp_path_factory.mktemp("browser"), allowed_origins=(ORIGIN,)) as (srv, url):
        yield srv, url


@pytest.fixture(scope="module")
def direct():
    """An engine of the same card for the expected results (the server's engine is its thread's)."""
    return Engine.from_card("tiny-wan", device="cpu")


@pytest.fixture(scope="module")
def finished(server):
    """One completed 5-frame video."""
    _, url = server
    video = client(url).videos.create_and_poll(prompt="a fox", size="32x32", poll_interval_ms=20, extra_body=FIVE)
    assert video.status == "completed", video.error
    return video


def _boxes(data: bytes) -> list[str]:
    """The kinds of an mp4's top-level boxes, in file order."""
    kinds, at = [], 0
    while at + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[at : at + 8])
        size = struct.unpack(">Q", data[at + 8 : at + 16])[0] if size == 1 else size
        kinds.append(kind.decode("latin-1"))
        if size == 0:  # to the end of the file
            break
        at += size
    return kinds


# 1. CORS -----------------------------------------------------------------------------------------


def test_cors_preflight_is_answered_before_the_key_and_only_with_allowed_origins(server, tiny_engine, tmp_path, monkeypatch):
    _, url = server
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    preflight = httpx.options(url + "/v1/videos", headers=ask)  # a browser sends no key on a preflight
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    listed = httpx.get(url + "/v1/videos", headers={**AUTH, "Origin": ORIGIN})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == ORIGIN
    assert {"Retry-After", "ETag", "Content-Range"} <= set(listed.headers["access-control-expose-headers"].split(", "))
    keyless = httpx.get(url + "/v1/videos", headers={"Origin": ORIGIN})  # the page can read why it was refused
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == ORIGIN

    refused = httpx.options(url + "/v1/videos", headers={**ask, "Origin": "http://elsewhere.example"})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "Origin" and error["code"] == "cors_not_allowed"
    assert "'http://elsewhere.example'" in error["message"] and "--allowed-origins" in error["message"]
    assert "access-control-allow-origin" not in refused.headers

    async def without_the_flag():  # the same app built without allowed origins, called in-process
        app = create_app(AsyncEngine(tiny_engine), VideoStore(tmp_path, 60), HttpSettings(api_key=KEY))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fvgraph") as plain:
            return [await plain.options("/v1/videos", headers=ask), await plain.options("/v1/videos", headers={**ask, **AUTH}),
                    await plain.get("/health", headers={"Origin": ORIGIN})]  # fmt: skip

    no_key, with_key, health = asyncio.run(without_the_flag())
    assert (no_key.status_code, with_key.status_code, health.status_code) == (401, 405, 200)
    assert not any(name.startswith("access-control-") for r in (no_key, with_key, health) for name in r.headers)

    with pytest.raises(ValueError, match="--allowed-origins 'http://app.example/' must be '\\*' or an origin"):
        HttpSettings(allowed_origins=("http://app.example/",))
    from typer.testing import CliRunner

    from fvgraph.cli import app
    from fvgraph.serving.http_server import HttpServer

    built = []
    monkeypatch.setattr(HttpServer, "run", lambda self, on_started=None: built.append(self.app.state.api.settings))
    result = CliRunner().invoke(app, ["serve", "-O0", "--port", "0", "-o", str(tmp_path / "cli"),
                                      "--allowed-origins", ORIGIN, "--allowed-origins", "*"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert built[0].allowed_origins == (ORIGIN, "*")
    result = CliRunner().invoke(app, ["serve", "-O0", "--port", "0", "-o", str(tmp_path / "cli"), "--allowed-origins", "app.example"])
    assert result.exit_code == 2 and "--allowed-origins 'app.example' must be" in result.output


# 2. HEAD -----------------------------------------------------------------------------------------


def test_head_answers_every_get_route_with_the_get_headers_and_no_body(server, finished):
    srv, url = server
    for route in srv.app.routes:
        if "GET" in getattr(route, "methods", ()):
            assert "HEAD" in route.methods, route.path
    video = finished.id
    paths = ["/health", "/ready", "/metrics", "/v1/videos", "/v1/videos?limit=1", f"/v1/videos/{video}",
             f"/v1/videos/{video}/content", f"/v1/videos/{video}/content?variant=thumbnail",
             f"/v1/videos/{video}/content?variant=spritesheet", f"/v1/videos/{video}/events", "/v1/loras"]  # fmt: skip
    for path in paths:
        got, head = httpx.get(url + path, headers=AUTH), httpx.head(url + path, headers=AUTH)
        assert head.status_code == got.status_code == 200, (path, head.status_code, got.status_code)
        assert head.content == b"" and got.content != b"", path
        for name in ("content-type", "etag", "cache-control", "accept-ranges", "last-modified"):
            assert head.headers.get(name) == got.headers.get(name), (path, name)
        if path not in ("/metrics", f"/v1/videos/{video}/events"):  # metrics move; a stream has no length
            assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content)), path
    missing = httpx.head(url + "/v1/videos/video_" + "0" * 32, headers=AUTH)
    assert missing.status_code == 404 and missing.content == b"" and missing.headers["content-type"] == "application/json"


# 3. faststart ------------------------------------------------------------------------------------


def test_served_and_written_mp4s_put_the_index_before_the_frames(server, finished, tmp_path):
    _, url = server
    served = client(url).videos.download_content(finished.id).read()
    boxes = _boxes(served)
    assert {"ftyp", "moov", "mdat"} <= set(boxes) and boxes.index("moov") < boxes.index("mdat"), boxes
    assert decode_mp4(served).shape == (5, 32, 32, 3)
    frames = np.random.default_rng(0).integers(0, 255, (5, 32, 32, 3), dtype=np.uint8)
    written = _boxes(write_video(frames, tmp_path / "cli.mp4", fps=4).read_bytes())  # `fvgraph generate`'s writer
    assert written.index("moov") < written.index("mdat"), written


# 4. ETag / If-None-Match -------------------------------------------------------------------------


def test_content_carries_an_etag_and_if_none_match_gets_304_ranges_as_before(server, finished):
    _, url = server
    content = f"{url}/v1/videos/{finished.id}/content"
    whole = httpx.get(content, headers=AUTH)
    tag = whole.headers["etag"]
    assert whole.status_code == 200 and tag.startswith('"') and whole.headers["accept-ranges"] == "bytes"
    for given in (tag, f"W/{tag}", f'"something-else", {tag}', "*"):
        again = httpx.get(content, headers={**AUTH, "If-None-Match": given})
        assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == tag, given
    assert httpx.get(content, headers={**AUTH, "If-None-Match": '"something-else"'}).content == whole.content
    thumbnail = httpx.get(content + "?variant=thumbnail", headers={**AUTH, "If-None-Match": tag})
    assert thumbnail.status_code == 200 and thumbnail.headers["etag"] != tag  # each variant its own tag

    part = httpx.get(content, headers={**AUTH, "Range": "bytes=0-99"})
    assert part.status_code == 206 and part.content == whole.content[:100] and part.headers["etag"] == tag
    assert part.headers["content-range"] == f"bytes 0-99/{len(whole.content)}"
    assert httpx.get(content, headers={**AUTH, "Range": "bytes=0-99", "If-Range": tag}).status_code == 206
    stale = httpx.get(content, headers={**AUTH, "Range": "bytes=0-99", "If-Range": '"older"'})
    assert stale.status_code == 200 and stale.content == whole.content  # If-Range no longer matches: all of it
    assert httpx.get(content, headers={**AUTH, "Range": "bytes=0-99", "If-None-Match": tag}).status_code == 304
    api = client(url)  # the SDK downloads as before
    assert api.videos.download_content(finished.id).read() == whole.content


# 5. pagination past a removed cursor -------------------------------------------------------------


def test_pages_go_on_after_their_cursor_is_deleted(server):
    _, url = server
    api = client(url)
    made = [api.videos.create(prompt=f"page {i}", size="32x32", extra_body={**QUICK, "num_frames": 1}).id for i in range(5)]
    first = api.videos.list(limit=2)
    assert [v.id for v in first.data] == made[::-1][:2]
    api.videos.delete(first.data[-1].id)  # the cursor of the next page goes
    after_gone = api.videos.list(limit=2, after=first.data[-1].id)
    assert [v.id for v in after_gone.data] == [made[2], made[1]] and after_gone.has_more
    upward = api.videos.list(limit=2, after=made[3], order="asc")
    assert [v.id for v in upward.data] == [made[4]]  # oldest first: past the deleted one's place

    everything = [v.id for v in api.videos.list(limit=100)]
    seen = []
    for video in api.videos.list(limit=1):  # the SDK follows last_id; each page's cursor is deleted before it asks on
        seen.append(video.id)
        if video.id in made:
            api.videos.delete(video.id)
    assert seen == everything and not {v.id for v in api.videos.list(limit=100)} & set(made)
    with pytest.raises(openai.BadRequestError, match="after: 'video_0+' is not a video id") as never:
        api.videos.list(after="video_" + "0" * 32)
    assert never.value.code == "invalid_value"


def test_pages_go_on_after_their_cursor_expires_here_and_on_a_shared_store(tmp_path):
    now = [1000.0]

    def video(store: VideoStore, n: int) -> StoredVideo:
        return store.add(StoredVideo(store.new_id("video"), "video", "tiny-wan", f"v{n}", "32x32", "1", 5, 4.0, 1000,
                                     added_ns=n + 1))  # fmt: skip (0 would be "now")

    store = VideoStore(tmp_path / "one", retention_s=10, clock=lambda: now[0])
    items = [video(store, n) for n in range(4)]
    store.finish(items[1].id, "completed", content={"video": b"mp4"})
    now[0] += 11  # items[1] expires
    assert [v.id for v in store.page(items[1].id, 10, "desc")[0]] == [items[0].id]
    assert [v.id for v in store.page(items[1].id, 10, "asc")[0]] == [items[2].id, items[3].id]
    now[0] += 11  # and its key is kept only as long as the retention
    with pytest.raises(KeyError):
        store.page(items[1].id, 10, "desc")

    a = SharedVideoStore(tmp_path / "shared", retention_s=60, owner="a", clock=lambda: now[0])
    b = SharedVideoStore(tmp_path / "shared", retention_s=60, owner="b", clock=lambda: now[0])
    shared = [video(a, n) for n in range(3)]
    b.remove(shared[1].id)  # deleted by a server that did not make it
    a.remove(shared[2].id)  # deleted by its maker
    for reader in (a, b):
        assert [v.id for v in reader.page(shared[1].id, 10, "desc")[0]] == [shared[0].id]
        assert [v.id for v in reader.page(shared[2].id, 10, "desc")[0]] == [shared[0].id]


# 6. Retry-After from the queue's measurements ----------------------------------------------------


def test_retry_after_is_the_queue_ahead_times_the_measured_seconds_per_request(tiny_engine):
    model = MemoryModel(tiny_engine)
    request = Request(prompt="x", num_frames=5, height=32, width=32, num_inference_steps=2)
    one = model.estimate(request.resolve(tiny_engine.card)).total
    now = [0.0]
    admission = Admission(model, budget_bytes=int(1.5 * one), max_queue=2, max_running=4, clock=lambda: now[0])

    def offer(name: str):
        return admission.offer(request.model_copy(update={"request_id": name}).resolve(tiny_engine.card))

    offer("a")
    assert [r.request_id for r in admission.admit()] == ["a"]
    admission.started("a")
    offer("b")  # b and c wait for memory
    offer("c")
    now[0] = 2.5  # nothing has ended: "a"'s 2.5 s so far stand in for the time per request
    with pytest.raises(QueueFull, match="retry after 5 s") as full:
        offer("d")
    assert full.value.retry_after == math.ceil(2 * 2.5) == admission.retry_after
    now[0] = 4.0
    admission.release("a")  # measured: 4 s from admission to the end
    assert [r.request_id for r in admission.admit()] == ["b"]
    with pytest.raises(QueueFull) as full:  # "b" admitted, not started, and "c" waiting: 2 ahead
        offer("e")
    assert full.value.retry_after == 8
    now[0] = 0.25 + 4.0
    admission.started("b")
    admission.release("b")  # 0.25 s
    assert admission.retry_after == math.ceil(1 * (4.0 + 0.25) / 2)  # "c" alone ahead, at the mean of the two


def test_a_full_queue_answers_retry_after_from_the_measured_time(server, monkeypatch):
    srv, url = server
    admission = srv.served.admission
    api = client(url)
    one = MemoryModel(srv.served.engine).estimate(
        Request(prompt="x", num_frames=5, height=32, width=32, num_inference_steps=2).resolve(srv.served.engine.card)
    ).total
    monkeypatch.setattr(admission, "_recent_seconds", deque(maxlen=32))  # only what this test measures
    slow_steps(monkeypatch, srv.served.engine, 0.3)
    measured = api.videos.create_and_poll(prompt="measured", size="32x32", poll_interval_ms=20,
                                          extra_body={**FIVE, "num_inference_steps": 5})  # fmt: skip
    assert measured.status == "completed" and admission._recent_seconds[0] > 1.5
    monkeypatch.setattr(admission, "budget", int(1.5 * one))  # one request runs at a time
    monkeypatch.setattr(admission, "max_queue", 1)
    running = api.videos.create(prompt="running", size="32x32", extra_body={**FIVE, "num_inference_steps": 50})
    wait_for(lambda: api.videos.retrieve(running.id).status == "in_progress", what="the first to run")
    waiting = api.videos.create(prompt="waiting", size="32x32", extra_body=FIVE)
    with pytest.raises(openai.RateLimitError, match="queue is full") as full:
        api.videos.create(prompt="one too many", size="32x32", extra_body=FIVE)
    retry_after = int(full.value.response.headers["retry-after"])
    assert full.value.code == "queue_full"
    assert retry_after == admission.retry_after == math.ceil(admission._recent_seconds[0]) >= 2  # 1 ahead, 1 running
    for video in (running, waiting):
        api.videos.delete(video.id)
    wait_for(lambda: srv.served.in_flight == 0, what="every request to end")


# 7. every error in OpenAI's shape ----------------------------------------------------------------


def test_framework_errors_are_openai_shaped_so_the_sdk_reads_their_code(server, finished):
    _, url = server
    api = client(url)
    with pytest.raises(openai.NotFoundError) as unknown_route:
        api.get("/no/such/route", cast_to=object)
    assert unknown_route.value.code == "not_found" and "GET /v1/no/such/route" in unknown_route.value.message
    with pytest.raises(openai.APIStatusError) as wrong_method:
        api.post(f"/videos/{finished.id}/content", cast_to=object)
    assert wrong_method.value.status_code == 405 and wrong_method.value.code == "method_not_allowed"
    with pytest.raises(openai.BadRequestError) as mistyped:  # FastAPI's validation (422) is a 400 naming the field
        api.videos.list(extra_query={"limit": "many"})
    assert mistyped.value.code == "invalid_value" and mistyped.value.param == "limit"
    with pytest.raises(openai.BadRequestError) as variant:
        api.videos.download_content(finished.id, variant="poster")
    assert variant.value.param == "variant" and "'spritesheet'" in variant.value.message

    size = len(httpx.get(f"{url}/v1/videos/{finished.id}/content", headers=AUTH).content)
    outside = httpx.get(f"{url}/v1/videos/{finished.id}/content", headers={**AUTH, "Range": f"bytes={size + 10}-"})
    error = outside.json()["error"]  # the framework's plain-text 416, reshaped
    assert outside.status_code == 416 and error["code"] == "range_not_satisfiable" and f"has {size} bytes" in error["message"]
    assert outside.headers["content-range"] == f"bytes */{size}"


# 8. remix and the spritesheet --------------------------------------------------------------------


def test_remix_reruns_a_completed_video_with_a_new_prompt_on_its_settings(server, direct, tiny_engine, monkeypatch):
    srv, url = server
    api = client(url)
    fields = {"num_inference_steps": 2, "guidance_scale": 3.0, "fps": 4}  # no seed: the engine picks one
    source = api.videos.create_and_poll(prompt="a fox", size="48x32", seconds="1", poll_interval_ms=20, extra_body=fields)
    seed = srv.store.get(source.id).settings["request"]["seed"]
    shape = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=3.0, seed=seed)
    assert np.array_equal(decode_mp4(api.videos.download_content(source.id).read()),
                          expected_video(direct, fps=4, prompt="a fox", **shape))  # the recorded seed is the one it ran with

    remix = api.videos.remix(source.id, prompt="a cat")
    assert remix.remixed_from_video_id == source.id and remix.prompt == "a cat" and remix.id != source.id
    assert (remix.size, remix.seconds, remix.model) == (source.size, source.seconds, source.model)
    done = api.videos.poll(remix.id, poll_interval_ms=20)
    assert done.status == "completed" and done.remixed_from_video_id == source.id
    cat = decode_mp4(api.videos.download_content(remix.id).read())
    assert np.array_equal(cat, expected_video(direct, fps=4, prompt="a cat", **shape))
    back = api.videos.poll(api.videos.remix(remix.id, prompt="a fox").id, poll_interval_ms=20)  # a remix of a remix
    assert np.array_equal(decode_mp4(api.videos.download_content(back.id).read()),
                          decode_mp4(api.videos.download_content(source.id).read()))  # fmt: skip

    with pytest.raises(openai.NotFoundError) as unknown:
        api.videos.remix("video_" + "0" * 32, prompt="x")
    assert unknown.value.code == "not_found" and unknown.value.param == "video_id"
    slow_steps(monkeypatch, tiny_engine, 0.05)
    busy = api.videos.create(prompt="busy", size="32x32", extra_body={**FIVE, "num_inference_steps": 50})
    with pytest.raises(openai.ConflictError, match="is (queued|in_progress); only a completed video") as unfinished:
        api.videos.remix(busy.id, prompt="x")
    assert unfinished.value.code == "remix_unavailable" and unfinished.value.param == "video_id"
    api.videos.delete(busy.id)
    with pytest.raises(openai.BadRequestError, match="unknown field; this endpoint takes prompt") as extra:
        api.videos.remix(source.id, prompt="x", extra_body={"seed": 3})
    assert extra.value.param == "seed"


def test_spritesheet_is_a_jpeg_grid_of_every_frame(server, direct, finished):
    _, url = server
    data = client(url).videos.download_content(finished.id, variant="spritesheet").read()
    sheet = Image.open(io.BytesIO(data))
    assert sheet.format == "JPEG" and sprite_grid(5) == (3, 2) and sheet.size == (3 * 32, 2 * 32)
    [result] = direct.generate([Request(prompt="a fox", height=32, width=32, num_frames=5, num_inference_steps=2, seed=1)])
    assert data == encode_spritesheet(result.frames)  # the frames the video was made of, in a 3 x 2 grid
    pixels = np.asarray(sheet.convert("RGB"), dtype=np.float32)
    for index in range(5):
        row, column = divmod(index, 3)
        tile = pixels[row * 32 : (row + 1) * 32, column * 32 : (column + 1) * 32]
        distances = [np.abs(tile - frame).mean() for frame in result.frames]  # JPEG is lossy: the nearest frame
        assert int(np.argmin(distances)) == index and distances[index] < 15, (index, distances)
    assert pixels[32:, 64:].mean() < 3  # the sixth cell has no frame: black
    big = encode_spritesheet(np.zeros((2, 480, 832, 3), np.uint8))
    assert Image.open(io.BytesIO(big)).size == (2 * 256, 148)  # tiles are scaled to at most 256 a side
