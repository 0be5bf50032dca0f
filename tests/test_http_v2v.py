"""Video-to-video over HTTP: an mp4 uploaded as /v1/videos' input_reference, with `strength` through the
openai SDK's extra_body, reaches Request(video=..., strength=...); bad uploads and fields get a 400
naming them, and nothing refused is kept."""

import io

import numpy as np
import pytest
from http_helpers import KEY, QUICK, client, httpx, live_server, openai

from fvgraph.engine.engine import Engine
from fvgraph.media_file import write_mp4
from fvgraph.request import Request
from fvgraph.serving.media_encode import decode_mp4, encode_mp4
from fvgraph.serving.video_upload import decode_video_upload

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated


def _mp4(tmp_path, frames: int, seed: int = 0, size: int = 32) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (frames, size, size, 3), dtype=np.uint8)
    path = tmp_path / f"in-{frames}-{seed}.mp4"
    write_mp4(pixels, path, 8)
    return path.read_bytes()


@pytest.fixture(scope="module")
def served(tiny_engine, tmp_path_factory):
    with live_server(tiny_engine, tmp_path_factory.mktemp("v2v-server")) as running:
        yield running


def test_an_uploaded_video_is_the_request_video_and_strength_comes_through_extra_body(served, tmp_path):
    srv, url = served
    api = client(url)
    upload = _mp4(tmp_path, 7)  # 7 frames: cut to the 5 the VAE takes (k * 4 + 1)

    def video(strength: float):
        made = api.videos.create_and_poll(prompt="a fox", size="32x32", poll_interval_ms=20, extra_body={**QUICK, "strength": strength},
                                          input_reference=("in.mp4", upload, "video/mp4"))  # fmt: skip
        assert made.status == "completed", made.error
        return decode_mp4(api.videos.download_content(made.id).read())

    low, same, high = video(0.5), video(0.5), video(1.0)
    assert low.shape == (5, 32, 32, 3)
    assert (low == same).all() and not (low == high).all()
    # An engine of its own (the server drives the served one) given the same decoded frames and fields.
    frames, note = decode_video_upload(upload, 33, 4096 * 4096, 4)
    assert len(frames) == 5 and "cut to its first 5" in note
    [direct] = Engine.from_card("tiny-wan", device="cpu").generate([Request(prompt="a fox", video=frames, strength=0.5, height=32, width=32, seed=QUICK["seed"],
                                             num_inference_steps=QUICK["num_inference_steps"])])  # fmt: skip
    assert direct.ok
    assert (decode_mp4(encode_mp4(direct.frames, QUICK["fps"])) == low).all()  # through the server's own mp4 encode


def test_bad_uploads_and_fields_are_400s_naming_them(served, tmp_path):
    srv, url = served
    headers = {"Authorization": f"Bearer {KEY}"}
    good = _mp4(tmp_path, 5)
    before = len(srv.store)
    cases = [
        ({"prompt": "x", "strength": "0.5"}, None, "strength", "upload the video"),
        ({"prompt": "x", "strength": "1.5"}, ("in.mp4", good, "video/mp4"), "strength", "less than or equal to 1"),
        ({"prompt": "x", "num_frames": "9"}, ("in.mp4", good, "video/mp4"), "input_reference", "has 5 frames, num_frames is 9"),
        ({"prompt": "x"}, ("in.mp4", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, "video/mp4"), "input_reference", "not a decodable mp4"),
        ({"prompt": "x"}, ("in.webm", b"\x1a\x45\xdf\xa3" + b"\x00" * 64, "video/webm"), "input_reference", "not a decodable webm"),
        ({"prompt": "x"}, ("in.mp4", _mp4(tmp_path, 40), "video/mp4"), "input_reference", "more than 33 frames"),
    ]
    for data, upload, field, rule in cases:
        files = None if upload is None else {"input_reference": upload}
        response = httpx.post(url + "/v1/videos", headers=headers, data=data, files=files, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400, (field, error)
        assert error["param"] == field and rule in error["message"], (field, error)
    assert len(srv.store) == before


def test_a_card_that_takes_no_video_refuses_the_upload(tmp_path):
    engine = Engine.from_card("tiny-wan-i2v", device="cpu")
    with live_server(engine, tmp_path) as (_, url):
        with pytest.raises(openai.BadRequestError, match="input_reference: card 'tiny-wan-i2v' takes no video"):
            client(url).videos.create(prompt="x", input_reference=("in.mp4", _mp4(tmp_path, 5), "video/mp4"))
