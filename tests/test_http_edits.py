"""POST /v1/images/edits through the official openai client's `images.edit`, against a live server of
the tiny-flux-kontext card (and one of tiny-qwen-image-edit): the PNG it returns equals the engine's
image for the same request; bad uploads and fields are 400s naming them, and a card that edits no
images refuses the upload unopened."""

import base64
import io

import numpy as np
import pytest
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from http_helpers import KEY, client, httpx, live_server, openai
from PIL import Image

from fvgraph.engine.engine import Engine
from fvgraph.request import Request

EDIT = {"num_inference_steps": 2, "seed": 3, "guidance_scale": 2.5}


def _png(seed: int, size: tuple[int, int] = (40, 24)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with live_server(Engine.from_card("tiny-flux-kontext", device="cpu"), tmp_path_factory.mktemp("edits")) as running:
        yield running


@pytest.mark.parametrize("kept", [{}, {"auto_resize": False}])
def test_images_edit_returns_the_engines_edit_as_a_png(served, kept):
    """The default, and the image kept at its own size (auto_resize false through extra_body)."""
    _, url = served
    upload = _png(1)
    answer = client(url).images.edit(model="tiny-flux-kontext", image=("in.png", upload, "image/png"), prompt="add a hat",
                                     size="48x32", extra_body={**EDIT, **kept})  # fmt: skip
    served_image = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))))
    engine = Engine.from_card("tiny-flux-kontext", device="cpu")  # the server drives its own
    requests = [Request(prompt="add a hat", image=Image.open(io.BytesIO(upload)), height=32, width=48, **EDIT, auto_resize=resize)
                for resize in (kept.get("auto_resize"), not kept.get("auto_resize", True))]  # fmt: skip
    direct, other = engine.generate(requests)
    assert direct.ok and served_image.shape == (32, 48, 3)
    assert (served_image == direct.images[0]).all()  # PNG is lossless: the same pixels
    assert not (served_image == other.images[0]).all()  # with the other auto_resize, another edit


def test_bad_edit_uploads_and_fields_are_400s_naming_them(served):
    srv, url = served
    headers = {"Authorization": f"Bearer {KEY}"}
    before = len(srv.store)
    cases = [
        ({"prompt": "x"}, None, "image", "upload the image to edit"),
        ({"prompt": "x"}, {"image": ("in.png", b"not an image", "image/png")}, "image", "not a decodable image"),
        ({"prompt": "x"}, {"image": ("in.png", _png(2), "image/png"), "mask": ("m.png", _png(3), "image/png")}, "mask", "leave mask out"),
        ({"prompt": "x", "n": "0"}, {"image": ("in.png", _png(2), "image/png")}, "n", "greater than or equal to 1"),
        ({"prompt": "x", "auto_resize": "maybe"}, {"image": ("in.png", _png(2), "image/png")}, "auto_resize", "boolean"),
    ]
    for data, files, field, rule in cases:
        response = httpx.post(url + "/v1/images/edits", headers=headers, data=data, files=files, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400, (field, error)
        assert error["param"] == field and rule in error["message"], (field, error)
    assert len(srv.store) == before


def test_a_card_that_edits_no_images_refuses_the_upload(tiny_engine, tmp_path):
    with live_server(tiny_engine, tmp_path) as (_, url):
        with pytest.raises(openai.BadRequestError, match="image: card 'tiny-wan' generates from text only"):
            client(url).images.edit(image=("in.png", _png(0), "image/png"), prompt="x")


@pytest.mark.parametrize("size", ["32x48", None])
def test_images_edit_on_a_qwen_image_edit_card_returns_the_engines_edit(tmp_path, size):
    """The same upload to tiny-qwen-image-edit, with true CFG through extra_body: its PNG is the engine's
    image; with no size, both at the image's edit size (QwenImageEditPipeline's `calculate_dimensions`
    of 1024^2 pixels at the image's aspect ratio: 1312 x 800 for a 40 x 24 image)."""
    upload, fields = _png(5), {"num_inference_steps": 2, "seed": 4, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
    engine = Engine.from_card("tiny-qwen-image-edit", device="cpu")
    with live_server(engine, tmp_path) as (_, url):
        answer = client(url).images.edit(model="tiny-qwen-image-edit", image=("in.png", upload, "image/png"), prompt="add a hat",
                                         extra_body=fields, **({} if size is None else {"size": size}))  # fmt: skip
    width, height = (32, 48) if size else calculate_dimensions(1024 * 1024, 40 / 24)[:2]
    served_image = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))))
    assert answer.size == f"{width}x{height}" and served_image.shape == (height, width, 3)
    [direct] = engine.generate([Request(prompt="add a hat", image=Image.open(io.BytesIO(upload)), **fields,
                                        **({} if size is None else {"height": height, "width": width}))])  # fmt: skip
    assert direct.ok
    assert (served_image == direct.images[0]).all()
