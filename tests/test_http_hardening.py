"""The HTTP server against hostile clients: uploads, abandoned calls, malformed bodies, wrong types,
media and timing values, restarts, streams, error shapes and seeds. Each refusal is a 400 in the
OpenAI shape naming the field the client sent, and the server serves on."""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import socket
import sys
from urllib.parse import urlsplit

import av
import pytest
from http_helpers import sse_events, httpx, KEY, QUICK, client, live_server, slow_steps, wait_for
from PIL import EpsImagePlugin, Image

from fvgraph.request import RequestRejected
from fvgraph.serving.openai_requests import check_input_reference
from fvgraph.serving.video_store import StoredVideo, VideoStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated
HEADERS = {"Authorization": f"Bearer {KEY}"}
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n"


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    with live_server(tiny_engine, tmp_path_factory.mktemp("hardening")) as (srv, url):
        yield srv, url


@pytest.fixture(scope="module")
def i2v_server(tmp_path_factory):
    from fvgraph.engine.engine import Engine

    with live_server(Engine.from_card("tiny-wan-i2v", device="cpu"), tmp_path_factory.mktemp("i2v")) as (srv, url):
        yield srv, url


def _encoded(image_format: str, size=(8, 8), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format=image_format)
    return buffer.getvalue()


def _post(url: str, path: str = "/v1/videos", **request) -> tuple[int, dict]:
    response = httpx.post(url + path, headers={**HEADERS, **request.pop("headers", {})}, timeout=60, **request)
    return response.status_code, response.json()


def _refused(url: str, param: str, path: str = "/v1/videos", **request) -> dict:
    status, body = _post(url, path, **request)
    assert status == 400 and set(body) == {"error"}, (status, body)
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers=HEADERS).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


# -- uploads --------------------------------------------------------------------------------------


def test_an_upload_reaches_only_the_png_jpeg_and_webp_decoders(tiny_card, monkeypatch):
    ran = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
    for image_format, data in [("EPS", EPS), ("TIFF", _encoded("TIFF")), ("BMP", _encoded("BMP")), ("GIF", _encoded("GIF"))]:
        with pytest.raises(RequestRejected, match="not a decodable image") as refused:
            check_input_reference(data, tiny_card, takes_image=True)
        assert refused.value.field == "input_reference", image_format
    assert ran == []  # the client's PostScript never reached Ghostscript
    for image_format in ("PNG", "JPEG", "WEBP"):
        assert check_input_reference(_encoded(image_format), tiny_card, takes_image=True).size == (8, 8)
    too_many = _encoded("PNG", (4097, 4097), mode="1")  # 2 kB of file, 16.8 M pixels: refused from the header
    with pytest.raises(RequestRejected, match="4097x4097 has more than"):
        check_input_reference(too_many, tiny_card, takes_image=True)


def test_a_text_only_card_refuses_an_upload_before_opening_it(tiny_card, monkeypatch):
    opened = []
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(args))
    for data in (EPS, _encoded("PNG"), b"not an image"):
        with pytest.raises(RequestRejected, match="takes no image"):
            check_input_reference(data, tiny_card, takes_image=False)
    assert opened == []


def test_an_eps_upload_over_http_is_refused_without_running_ghostscript(i2v_server, monkeypatch):
    _, url = i2v_server
    ran = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
    error = _refused(url, "input_reference", data={"prompt": "x", **QUICK},
                     files={"input_reference": ("ref.eps", EPS, "application/postscript")})  # fmt: skip
    assert "PNG, JPEG, WebP" in error["message"] and ran == []


# -- abandoned clients ----------------------------------------------------------------------------


def test_a_client_that_hangs_up_on_images_cancels_all_of_its_requests(server, tiny_engine, monkeypatch):
    srv, url = server
    slow_steps(monkeypatch, tiny_engine, 0.05)
    cancelled = _metric(url, 'fvgraph_cancellations_total{reason="client"}')
    body = {"prompt": "abandoned", "n": 8, "size": "32x32", "num_inference_steps": 50}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/images/generations", headers=HEADERS, json=body, timeout=1.0)
    wait_for(lambda: _metric(url, 'fvgraph_cancellations_total{reason="client"}') == cancelled + 8,
             what="the 8 abandoned images to be cancelled")  # fmt: skip
    wait_for(lambda: srv.served.in_flight == 0, what="nothing left in flight")
    assert srv.served.admission.reserved_bytes == 0
    kept = client(url).images.generate(prompt="after", size="32x32", extra_body={"num_inference_steps": 2})
    assert len(kept.data) == 1  # a client that stays gets its image


# -- malformed bodies -----------------------------------------------------------------------------

DEEP = "[" * 1500 + "]" * 1500


@pytest.fixture
def python_recursion_limit():
    """Python's default recursion limit, which what counts as "too deep to parse" depends on: torch's
    compiler raises it for the whole process, so earlier compiling tests would otherwise change it."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(old)


@pytest.mark.parametrize("path", ["/v1/videos", "/v1/images/generations"])
@pytest.mark.parametrize("text, param", [
    ('{"prompt": "x", "cache": ' + DEEP + "}", "cache"),  # past the parser's own limit
    ('{"prompt": "x", "junk": ' + "[" * 40 + "]" * 40 + "}", "junk"),  # parses, but nests past MAX_JSON_DEPTH
    ('{"prompt": "x \\" [[[", "seed": ' + '{"a": ' * 1500 + "1" + "}" * 1500 + "}", "seed"),  # brackets in a string
    (DEEP, "body"),
], ids=["past-the-parser", "past-the-limit", "brackets-in-a-string", "not-an-object"])  # fmt: skip
def test_a_deeply_nested_body_is_a_400_naming_its_field(server, path, text, param, python_recursion_limit):
    _, url = server
    error = _refused(url, param, path, content=text.encode(), headers={"Content-Type": "application/json"})
    assert "nested deeper than" in error["message"]


# -- types ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [
    {"method": ["magcache"]}, {"method": {"magcache": 1}}, [1, 2], 7,
    {"method": "magcache", "mag_ratios": json.loads("[" * 30 + "1" + "]" * 30)},
], ids=["method-a-list", "method-an-object", "a-list", "a-number", "nested-mag-ratios"])  # fmt: skip
def test_a_cache_of_the_wrong_type_is_a_400_naming_cache(server, cache):
    _, url = server
    _refused(url, "cache", json={"prompt": "x", "cache": cache})


def test_a_cache_text_nested_past_the_parser_is_a_400_naming_cache(server, python_recursion_limit):
    _, url = server
    for text in ("magcache:mag_ratios=" + DEEP, "{" + '"a": {' * 1500 + "}" * 1500):
        error = _refused(url, "cache", data={"prompt": "x", "cache": text})
        assert "nested past the JSON parser's depth" in error["message"] or "is not a JSON object" in error["message"]


@pytest.mark.parametrize("field, path", [
    ("num_frames", "/v1/videos"), ("num_inference_steps", "/v1/videos"), ("seed", "/v1/videos"),
    ("guidance_scale", "/v1/videos"), ("fps", "/v1/videos"), ("seconds", "/v1/videos"), ("timeout", "/v1/videos"),
    ("n", "/v1/images/generations"), ("seed", "/v1/images/generations"),
])  # fmt: skip
def test_a_boolean_is_not_a_number(server, field, path):
    _, url = server
    for value in (True, False):
        error = _refused(url, field, path, json={"prompt": "x", "size": "32x32", field: value})
        assert "not a boolean" in error["message"]


def test_non_finite_numbers_are_refused(server):
    _, url = server
    for field in ("guidance_scale", "timeout", "fps", "seconds"):
        _refused(url, field, content=f'{{"prompt": "x", "{field}": NaN}}'.encode(), headers={"Content-Type": "application/json"})
        _refused(url, field, data={"prompt": "x", field: "inf"})


# -- what the card cannot serve is refused at once --------------------------------------------------


def test_an_image_to_video_request_without_an_image_or_with_an_uncalibrated_cache_is_a_400(i2v_server):
    srv, url = i2v_server
    before = len(srv.store)
    error = _refused(url, "input_reference", data={"prompt": "x", "size": "32x32", **QUICK})
    assert "generates video from an image" in error["message"]
    files = {"input_reference": ("ref.png", _encoded("PNG", (32, 32)), "image/png")}
    error = _refused(url, "cache", data={"prompt": "x", "size": "32x32", **QUICK, "cache": "magcache"}, files=files)
    assert error["message"].startswith("cache.mag_ratios: not given, and none calibrated for card 'tiny-wan-i2v'")
    assert len(srv.store) == before  # nothing was accepted


def test_magcache_with_nothing_calibrated_is_a_400(server, tiny_engine, tmp_path, monkeypatch):
    srv, url = server
    monkeypatch.setattr(tiny_engine.loop.caching.calibration, "root", tmp_path)  # nothing calibrated here
    before = len(srv.store)
    for cache in ("magcache", {"method": "magcache", "threshold": 0.1}):
        error = _refused(url, "cache", json={"prompt": "x", "size": "32x32", **QUICK, "cache": cache})
        assert "cache.mag_ratios: not given, and none calibrated" in error["message"]
    _refused(url, "cache", "/v1/images/generations", json={"prompt": "x", "size": "32x32", "cache": "magcache"})
    assert len(srv.store) == before


# -- media and timing -----------------------------------------------------------------------------


@pytest.mark.parametrize("fps", [0.0001, 0.5, 121])
def test_an_fps_the_mp4_cannot_be_written_at_is_refused(server, fps):
    _, url = server
    _refused(url, "fps", json={"prompt": "x", "size": "32x32", "fps": fps})


def test_seconds_is_what_was_rendered_at_the_rate_written(server):
    _, url = server
    api = client(url)
    for extra, seconds, rate in [({"num_frames": 5, "fps": 7.5}, "0.666667", 7.5), ({"seconds": 1, "fps": 4}, "1.25", 4)]:
        created = api.videos.create(prompt="timed", size="32x32", extra_body={**QUICK, **extra})
        assert created.seconds == seconds
        video = api.videos.poll(created.id, poll_interval_ms=20)
        assert video.status == "completed" and video.seconds == seconds
        with av.open(io.BytesIO(api.videos.download_content(video.id).read())) as container:
            stream = container.streams.video[0]
            assert float(stream.average_rate) == rate and stream.frames == 5


def test_a_non_finite_retention_is_refused_naming_the_option(tmp_path):
    for value in (math.inf, math.nan, 0, -1):
        with pytest.raises(ValueError, match=r"--retention-s"):
            VideoStore(tmp_path, retention_s=value)


def test_a_failed_write_leaves_no_file_of_its_video(tmp_path, monkeypatch):
    store = VideoStore(tmp_path, retention_s=60)
    item = store.add(StoredVideo(store.new_id("video"), "video", "m", "p", "32x32", "1", 5, 4.0, 1000))
    real_replace = os.replace

    def full_disk(source, target):
        if str(target).endswith(".jpg"):
            raise OSError(28, "No space left on device")
        return real_replace(source, target)

    monkeypatch.setattr("fvgraph.serving.video_store.os.replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        store.finish(item.id, "completed", content={"video": b"mp4", "thumbnail": b"jpg"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{item.id}.json"]  # its record; no content, no partial
    assert store.finish(item.id, "failed", {"code": "encoding_failed", "message": "disk full"})
    assert store.get(item.id).status == "failed"


# -- persistence ----------------------------------------------------------------------------------


def test_a_restarted_store_adopts_its_records_and_removes_what_it_cannot(tmp_path):
    now = [1000.0]
    first = VideoStore(tmp_path, retention_s=60, clock=lambda: now[0])
    done, failed, running, image = (first.add(StoredVideo(first.new_id(kind), kind, "m", f"p{i}", "32x32", "1", 5, 4.0, 990 + i))
                                    for i, kind in enumerate(["video", "video", "video", "image"]))  # fmt: skip
    first.finish(done.id, "completed", content={"video": b"mp4", "thumbnail": b"jpg"})
    first.finish(failed.id, "failed", {"code": "generation_failed", "message": "boom"})
    first.update(running.id, status="in_progress")
    first.finish(image.id, "completed", content={"image": b"png"})
    stray, broken = first.new_id("video"), first.new_id("video")
    (tmp_path / f"{stray}.mp4").write_bytes(b"no record")
    (tmp_path / f".{stray}.mp4.1a2b3c4d.partial").write_bytes(b"half")
    (tmp_path / f"{broken}.json").write_text("{torn")
    (tmp_path / f"{broken}.jpg").write_bytes(b"jpg")
    (tmp_path / "notes.txt").write_text("not the store's")

    now[0] = 1030.0
    second = VideoStore(tmp_path, retention_s=60, clock=lambda: now[0])
    assert second.content(done.id, "video").read_bytes() == b"mp4" and second.get(done.id).expires_at == 1060
    assert second.get(failed.id).error["code"] == "generation_failed"
    assert second.get(running.id).status == "failed" and second.get(running.id).error["code"] == "interrupted"
    assert second.content(image.id, "image").read_bytes() == b"png"
    assert [v.id for v in second.page(None, 10, "asc")[0]] == [done.id, failed.id, running.id]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{done.id}.json", f"{done.id}.mp4", f"{done.id}.jpg", f"{failed.id}.json", f"{running.id}.json",
         f"{image.id}.json", f"{image.id}.png", "notes.txt"])  # fmt: skip
    now[0] = 1100.0  # past every retention: the adopted expire as their own would
    assert sorted(second.expire()) == sorted([done.id, failed.id, running.id, image.id])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# -- streams --------------------------------------------------------------------------------------


def test_the_stream_of_an_ended_video_sends_its_final_video_once(server, tiny_engine, monkeypatch):
    _, url = server
    api = client(url)
    done = api.videos.create_and_poll(prompt="done", size="32x32", poll_interval_ms=20, extra_body=QUICK)
    slow_steps(monkeypatch, tiny_engine, 0.05)
    timed_out = api.videos.poll(api.videos.create(prompt="late", size="32x32",
                                                  extra_body={**QUICK, "num_inference_steps": 20, "timeout": 0.01}).id,
                                poll_interval_ms=20)  # fmt: skip
    assert timed_out.status == "failed" and timed_out.error.code == "timeout"
    for video in (done, timed_out):
        events = sse_events(url, video.id, timeout_s=30)
        assert [kind for kind, _ in events] == ["video"] and events[0][1]["status"] == video.status


# -- every error in the OpenAI shape --------------------------------------------------------------


def test_framework_errors_are_openai_shaped_naming_what_the_client_sent(server):
    _, url = server
    for query, param in (("limit=abc", "limit"), ("limit=1.5", "limit"), ("limit=0", "limit"), ("order=up", "order")):
        response = httpx.get(f"{url}/v1/videos?{query}", headers=HEADERS)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    many_fields = {f"f{i}": "x" for i in range(1001)}
    _refused(url, "body", files={**{k: (None, v) for k, v in many_fields.items()}, "prompt": (None, "x")})
    _refused(url, "body", files={f"f{i}": (f"{i}.bin", b"x") for i in range(1001)})
    _refused(url, "body", content=b"prompt=x&" * 1001, headers={"Content-Type": "application/x-www-form-urlencoded"})
    _refused(url, "body", content=b"--x\r\n", headers={"Content-Type": "multipart/form-data"})  # no boundary
    _refused(url, "cache", json={"prompt": "x", "cache": [1, 2]})
    for method, path, status in (("GET", "/v1/nothing", 404), ("PUT", "/v1/videos", 405)):
        response = httpx.request(method, url + path, headers=HEADERS)
        assert response.status_code == status and set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("method, path, allowed", [
    ("POST", "/health", "GET, HEAD"),  # a GET route answers HEAD as well
    ("OPTIONS", "/health", "GET, HEAD"),  # answered only as a CORS preflight, with --allowed-origins
    ("GET", "/v1/images/generations", "POST"),
    ("PUT", "/v1/videos", "GET, HEAD, POST"),  # two routes on one path: list and create
    ("PATCH", "/v1/videos/video_none", "DELETE, GET, HEAD"),
    ("DELETE", "/v1/loras", "GET, HEAD, POST"),
])  # fmt: skip
def test_a_405_allows_every_method_routed_for_its_path_and_only_those(server, method, path, allowed):
    _, url = server
    refused = httpx.request(method, url + path, headers=HEADERS)
    assert (refused.status_code, refused.headers["allow"]) == (405, allowed), refused.text
    assert refused.json()["error"]["code"] == "method_not_allowed"
    for listed in allowed.split(", "):  # each one listed reaches its endpoint (an empty body is a 400, an unknown id a 404)
        assert httpx.request(listed, url + path, headers=HEADERS).status_code != 405, listed


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_client_that_drops_mid_body_logs_one_line_and_no_traceback(server, caplog):
    _, url = server
    errors = _Records()
    logging.getLogger("uvicorn.error").addHandler(errors)
    caplog.set_level(logging.INFO, logger="fvgraph.serving.http_errors")
    address = urlsplit(url)
    try:
        for kind, start in (("application/json", b'{"prompt": "a'), ("multipart/form-data; boundary=b", b"--b\r\n")):
            with socket.create_connection((address.hostname, address.port)) as connection:
                head = (f"POST /v1/videos HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
                        f"Content-Type: {kind}\r\nContent-Length: 100000\r\n\r\n")  # fmt: skip
                connection.sendall(head.encode() + start)
        wait_for(lambda: sum("hung up" in r.getMessage() for r in caplog.records) == 2, what="both hang-ups logged")
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert errors.messages == []
    assert httpx.get(url + "/health").status_code == 200


# -- seeds ----------------------------------------------------------------------------------------


def test_the_largest_seed_serves_any_number_of_images_wrapping_modulo_2_to_the_63(server):
    _, url = server
    api = client(url)
    steps = {"num_inference_steps": 2}
    two = api.images.generate(prompt="a fox", size="32x32", n=2, extra_body={**steps, "seed": 2**63 - 1})
    last = api.images.generate(prompt="a fox", size="32x32", extra_body={**steps, "seed": 2**63 - 1})
    zero = api.images.generate(prompt="a fox", size="32x32", extra_body={**steps, "seed": 0})
    assert len(two.data) == 2
    assert base64.b64decode(two.data[0].b64_json) == base64.b64decode(last.data[0].b64_json)
    assert base64.b64decode(two.data[1].b64_json) == base64.b64decode(zero.data[0].b64_json)  # 2**63 wraps to 0
    _refused(url, "seed", "/v1/images/generations", json={"prompt": "x", "seed": 2**63})
