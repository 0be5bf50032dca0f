"""/v1/videos serving HunyuanVideo-1.5 through the official openai client: `model` names the card, an
image-to-video card takes `input_reference` as its image, and the mp4 holds what the engine makes of
the same request run directly (through the same deterministic H.264 encode)."""

import io

import numpy as np
import pytest
from http_helpers import QUICK, client, expected_video, live_server
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from PIL import Image

from fvgraph.cards import get_card
from fvgraph.engine.engine import Engine
from fvgraph.serving.media_encode import decode_mp4

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated
IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8))


def _png(image: Image.Image) -> tuple[str, bytes, str]:
    upload = io.BytesIO()
    image.save(upload, format="PNG")
    return ("ref.png", upload.getvalue(), "image/png")


def _served(engine, tmp_path, card: str, size: str | None, **fields):
    """The decoded mp4 of one video made over HTTP with `model=card` (`size` None: none sent), and
    the size its Video object reports."""
    with live_server(engine, tmp_path) as (_, url):
        api = client(url)
        made = api.videos.create_and_poll(model=card, prompt="a lantern on a pier", seconds="1", poll_interval_ms=20,
                                          extra_body={**QUICK, "negative_prompt": "blurry"},
                                          **fields, **({} if size is None else {"size": size}))  # fmt: skip
        assert made.status == "completed", made.error
        assert made.model == card and made.size == (size or made.size)
        return decode_mp4(api.videos.download_content(made.id).read()), made.size


def test_a_text_to_video_card_is_served_by_name(tmp_path):
    card = "tiny-hunyuanvideo1.5"
    frames, _ = _served(Engine.from_card(card, device="cpu"), tmp_path, card, "48x32")
    assert frames.shape == (5, 32, 48, 3)  # 1 s at 4 fps -> the nearest 4k+1 frames
    direct = Engine.from_card(card, device="cpu")  # the server's engine ran in its own thread
    assert np.array_equal(frames, expected_video(direct, fps=4, prompt="a lantern on a pier", negative_prompt="blurry", height=32,
                                                 width=48, num_frames=5, num_inference_steps=2, seed=1))  # fmt: skip


def test_an_image_to_video_card_takes_input_reference_as_its_image(tmp_path):
    card = "tiny-hunyuanvideo1.5-i2v"
    frames, _ = _served(Engine.from_card(card, device="cpu"), tmp_path, card, "32x32", input_reference=_png(IMAGE))
    assert frames.shape == (5, 32, 32, 3)
    direct = Engine.from_card(card, device="cpu")
    assert np.array_equal(frames, expected_video(direct, fps=4, prompt="a lantern on a pier", negative_prompt="blurry", image=IMAGE,
                                                 height=32, width=32, num_frames=5, num_inference_steps=2, seed=1))  # fmt: skip


def test_an_image_to_video_request_without_a_size_runs_at_the_images_bucket(tmp_path):
    """As HunyuanVideo15ImageToVideoPipeline sizes a call without height and width (its video
    processor's bucket for the transformer's target size) and as the Python API runs it: a tall image
    on a card whose default size is wide."""
    card = "tiny-hunyuanvideo1.5-i2v"
    tall = Image.fromarray(np.random.default_rng(1).integers(0, 256, (70, 40, 3), dtype=np.uint8))
    spec = get_card(card).components["transformer"]
    height, width = HunyuanVideo15ImageProcessor(vae_scale_factor=16).calculate_default_height_width(
        height=tall.height, width=tall.width, target_size=spec.config["target_size"])  # the pipeline's call
    assert (width, height) != (get_card(card).shapes.default_width, get_card(card).shapes.default_height)
    frames, size = _served(Engine.from_card(card, device="cpu"), tmp_path, card, None, input_reference=_png(tall))
    assert size == f"{width}x{height}" and frames.shape == (5, height, width, 3)
    direct = Engine.from_card(card, device="cpu")
    assert np.array_equal(frames, expected_video(direct, fps=4, prompt="a lantern on a pier", negative_prompt="blurry", image=tall,
                                                 num_frames=5, num_inference_steps=2, seed=1))  # fmt: skip
