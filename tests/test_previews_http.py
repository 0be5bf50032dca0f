"""Step previews over HTTP: `preview_every` on POST /v1/videos gives `preview` events (PNG, base64) on
the video's event stream, each right after its step's event; bad values are a 400 naming the field."""

import base64
import io

import numpy as np
import pytest
from http_helpers import sse_events, KEY, QUICK, client, httpx, live_server
from PIL import Image

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    with live_server(tiny_engine, tmp_path_factory.mktemp("http-previews")) as (srv, url):
        yield srv, url


def test_preview_events_follow_their_steps_as_png(server):
    _, url = server
    video = client(url).videos.create(prompt="previewed", size="32x32",
                                      extra_body={**QUICK, "num_inference_steps": 5, "preview_every": 2})  # fmt: skip
    events = sse_events(url, video.id)
    previews = [(i, body) for i, (kind, body) in enumerate(events) if kind == "preview"]
    assert [(body["step"], body["total"]) for _, body in previews] == [(2, 5), (4, 5), (5, 5)]
    for i, body in previews:
        kind, step = events[i - 1]
        assert kind == "step" and step["step"] == body["step"]  # right after its own step
        assert body["image"]["mime"] == "image/png"
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["image"]["base64"]))))
        assert image.dtype == np.uint8 and image.shape == (4, 4, 3)  # 32 x 32 at the VAE's 8x
    assert [kind for kind, _ in events][-2:] == ["done", "video"]


def test_a_video_without_preview_every_streams_no_previews(server):
    _, url = server
    video = client(url).videos.create(prompt="plain", size="32x32", extra_body={**QUICK, "num_inference_steps": 2})
    assert "preview" not in [kind for kind, _ in sse_events(url, video.id)]


@pytest.mark.parametrize("value", [0, -1, 1001, 2.5, "two", True, 5])
def test_bad_preview_every_is_a_400_naming_the_field(server, value):
    _, url = server
    body = {"prompt": "x", "size": "32x32", **QUICK, "num_inference_steps": 4, "preview_every": value}
    response = httpx.post(url + "/v1/videos", headers=HEADERS, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "preview_every"
