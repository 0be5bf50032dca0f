"""/v1/videos serving HunyuanVideo-1.5 through the official openai client: `model` names the card, an
image-to-video card takes `input_reference` as its image, and the mp4 holds what the engine makes of
the same request run directly (through the same deterministic H.264 encode)."""

import io

import numpy as np
import pytest
from http_helpers import QUICK, client, expected_video, live_server
from PIL import Image

from fvgraph.engine.engine import Engine
from fvgraph.serving.media_encode import decode_mp4

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated


def _served(engine, tmp_path, card: str, size: str, **fields):
    """The decoded mp4 of one video made over HTTP with `model=card`."""
    with live_server(engine, tmp_path) as (_, url):
        api = client(url)
        made = api.videos.create_and_poll(model=card, prompt="a lantern on a pier", size=size, seconds="1", poll_interval_ms=20,
                                          extra_body={**QUICK, "negative_prompt": "blurry"}, **fields)  # fmt: skip
        assert made.status == "completed", made.error
        assert made.model == card and made.size == size
        return decode_mp4(api.videos.download_content(made.id).read())


def test_a_text_to_video_card_is_served_by_name(tmp_path):
    card = "tiny-hunyuanvideo1.5"
    frames = _served(Engine.from_card(card, device="cpu"), tmp_path, card, "48x32")
    assert frames.shape == (5, 32, 48, 3)  # 1 s at 4 fps -> the nearest 4k+1 frames
    direct = Engine.from_card(card, device="cpu")  # the server's engine ran in its own thread
    assert np.array_equal(frames, expected_video(direct, fps=4, prompt="a lantern on a pier", negative_prompt="blurry", height=32,
                                                 width=48, num_frames=5, num_inference_steps=2, seed=1))  # fmt: skip


def test_an_image_to_video_card_takes_input_reference_as_its_image(tmp_path):
    card = "tiny-hunyuanvideo1.5-i2v"
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8))
    upload = io.BytesIO()
    image.save(upload, format="PNG")
    frames = _served(Engine.from_card(card, device="cpu"), tmp_path, card, "32x32",
                     input_reference=("ref.png", upload.getvalue(), "image/png"))  # fmt: skip
    assert frames.shape == (5, 32, 32, 3)
    direct = Engine.from_card(card, device="cpu")
    assert np.array_equal(frames, expected_video(direct, fps=4, prompt="a lantern on a pier", negative_prompt="blurry", image=image,
                                                 height=32, width=32, num_frames=5, num_inference_steps=2, seed=1))  # fmt: skip
