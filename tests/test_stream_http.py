"""`GET /v1/videos/{id}/content?stream=true`: fragmented MP4 while the video decodes. The bytes a client
holds before the request ends decode (PyAV) to the first frames of the stored file; a client that hangs
up frees its own stream only; a bad `stream` is a 400 naming it."""

import io
import time

import av
import numpy as np
import pytest
from http_helpers import KEY, client, httpx, live_server, wait_for

from fvgraph.serving.media_encode import decode_mp4

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated
HEADERS = {"Authorization": f"Bearer {KEY}"}
STREAMED = {"num_inference_steps": 2, "fps": 8, "seed": 1, "num_frames": 17}  # 5 decode steps of 1 + 4 x 4 frames


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    with live_server(tiny_engine, tmp_path_factory.mktemp("http-stream")) as (srv, url):
        yield srv, url


@pytest.fixture
def slow_decode(monkeypatch, tiny_engine):
    """Each decode step takes 0.8 s longer, so a client reads while the rest decodes (libx264's lookahead
    holds the first fragment back until about 12 of the 17 frames are in)."""
    run_batch = tiny_engine.executor.run_batch

    def run(plans, slots, lane=0):
        if plans[0].kind == "vae_decode_chunk":
            time.sleep(0.8)
        return run_batch(plans, slots, lane)

    monkeypatch.setattr(tiny_engine.executor, "run_batch", run)


def _frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_the_bytes_streamed_before_the_request_ends_play_as_the_stored_files_first_frames(server, slow_decode):
    srv, url = server
    video = client(url).videos.create(prompt="streamed", size="32x32", extra_body=STREAMED)
    early, late = bytearray(), bytearray()
    with httpx.stream("GET", f"{url}/v1/videos/{video.id}/content?stream=true", headers=HEADERS, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
        assert response.headers.get("transfer-encoding") == "chunked" and "content-length" not in response.headers
        for piece in response.iter_bytes():
            (early if srv.served.knows(video.id) else late).extend(piece)  # knows: accepted and not yet ended
    wait_for(lambda: client(url).videos.retrieve(video.id).status == "completed", what="the stored file")
    stored = decode_mp4(httpx.get(f"{url}/v1/videos/{video.id}/content", headers=HEADERS, timeout=30).content)
    first = _frames(bytes(early))
    assert 0 < len(first) < len(stored) == 17
    assert np.array_equal(first, stored[: len(first)])  # same encoder, same settings: the same pixels
    assert np.array_equal(_frames(bytes(early + late)), stored)
    assert video.id not in srv.app.state.api.streams.live  # forgotten once the file is stored


def test_a_completed_video_streams_as_its_stored_file(server):
    _, url = server
    video = client(url).videos.create_and_poll(prompt="done first", size="32x32", poll_interval_ms=20,
                                               extra_body={**STREAMED, "num_frames": 5})  # fmt: skip
    plain = httpx.get(f"{url}/v1/videos/{video.id}/content", headers=HEADERS, timeout=30)
    streamed = httpx.get(f"{url}/v1/videos/{video.id}/content?stream=true", headers=HEADERS, timeout=30)
    assert streamed.status_code == 200 and streamed.content == plain.content


def test_a_client_that_hangs_up_frees_its_stream_and_nothing_else(server, slow_decode):
    srv, url = server
    streams = srv.app.state.api.streams
    video = client(url).videos.create(prompt="two readers", size="32x32", extra_body=STREAMED)
    other = client(url).videos.create(prompt="beside it", size="32x32", extra_body={**STREAMED, "seed": 2})
    stream_url = f"{url}/v1/videos/{video.id}/content?stream=true"
    with httpx.stream("GET", stream_url, headers=HEADERS, timeout=60) as staying:
        live = streams.live[video.id]  # opened by the request, whose headers are in
        with httpx.stream("GET", stream_url, headers=HEADERS, timeout=60):
            wait_for(lambda: live.readers == 2, what="two readers")
        # The client closed its connection: the server drops that reader (Starlette cancels its
        # stream) while the video still decodes.
        wait_for(lambda: live.readers == 1, what="the reader that hung up to be dropped")
        assert not live.ended, "the stream ended before the hang-up was seen: slow the decode more"
        kept = b"".join(staying.iter_bytes())
    api = client(url)
    for made in (video, other):
        wait_for(lambda: api.videos.retrieve(made.id).status == "completed", what=f"{made.id} to complete")
    stored = decode_mp4(httpx.get(f"{url}/v1/videos/{video.id}/content", headers=HEADERS, timeout=30).content)
    assert np.array_equal(_frames(bytes(kept)), stored) and live.readers == 0


@pytest.mark.parametrize("query", ["stream=yes", "stream=2", "stream=", "stream=true&variant=thumbnail"])
def test_a_bad_stream_value_is_a_400_naming_the_field(server, query):
    _, url = server
    video = client(url).videos.create(prompt="x", size="32x32", extra_body={**STREAMED, "num_frames": 1})
    response = httpx.get(f"{url}/v1/videos/{video.id}/content?{query}", headers=HEADERS, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream"
