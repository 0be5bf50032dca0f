"""What the official openai client and the peers' servers' clients (SGLang's, vLLM-Omni's) send, served
by tiny-wan at -O0: OpenAI's image fields, the peers' extension fields and `extra_params`, frame counts
rounded to the card's rule, errors naming the field as it was sent, model names and GET /v1/models.
The peers' request shapes (forms and JSON their docs and tests send) are written here as plain httpx."""

from __future__ import annotations

import base64
import io
import logging

import numpy as np
import pytest
from http_helpers import httpx, openai, KEY, client, live_server
from PIL import Image

from fvgraph.serving.media_encode import decode_mp4
from fvgraph.serving.model_names import ServedNames

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated
HEADERS = {"Authorization": f"Bearer {KEY}"}
ONE_STEP = {"num_inference_steps": 1, "seed": 1}
REPO_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    names = ServedNames.of("tiny-wan", ["sora-2"], checkpoint=f"/weights/{REPO_ID.split('/')[1]}")  # a plain folder
    with live_server(tiny_engine, tmp_path_factory.mktemp("clients"), model_names=names) as (srv, url):
        yield srv, url


def _post(url: str, path: str, **request) -> httpx.Response:
    return httpx.post(url + path, headers=HEADERS, timeout=120, **request)


def _refused(url: str, param: str, path: str = "/v1/videos", **request) -> str:
    response = _post(url, path, **request)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, error
    return error["message"]


def _video(url: str, video_id: str) -> np.ndarray:
    api = client(url)
    video = api.videos.poll(video_id, poll_interval_ms=20)
    assert video.status == "completed", video.error
    return decode_mp4(api.videos.download_content(video_id).read())


# -- OpenAI's image fields ------------------------------------------------------------------------


def test_output_format_encodes_each_image_so_as_b64_or_url(server):
    _, url = server
    api = client(url)
    for fmt, pil_name in (("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")):
        image = api.images.generate(prompt="a fox", size="32x32", output_format=fmt, extra_body=ONE_STEP)
        assert image.output_format == fmt
        assert Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json))).format == pil_name
    small = api.images.generate(prompt="a fox", size="32x32", output_format="jpeg", output_compression=5, extra_body=ONE_STEP)
    assert len(base64.b64decode(small.data[0].b64_json)) < len(base64.b64decode(image.data[0].b64_json))

    linked = api.images.generate(prompt="a fox", size="32x32", output_format="webp", response_format="url", extra_body=ONE_STEP)
    fetched = httpx.get(linked.data[0].url, headers=HEADERS)
    assert fetched.headers["content-type"] == "image/webp" and Image.open(io.BytesIO(fetched.content)).format == "WEBP"
    default = _post(url, "/v1/images/generations", json={"prompt": "a fox", "size": "32x32", "output_format": None,
                                                          "response_format": None, **ONE_STEP}).json()  # fmt: skip
    assert default["output_format"] == "png" and Image.open(io.BytesIO(base64.b64decode(default["data"][0]["b64_json"]))).format == "PNG"
    assert "jpeg and webp" in _refused(url, "output_compression", "/v1/images/generations",
                                       json={"prompt": "x", "output_compression": 50})  # fmt: skip


def test_n_up_to_10_images_and_never_more_than_the_queue_takes(server, monkeypatch):
    srv, url = server
    ten = client(url).images.generate(prompt="a fox", size="16x16", n=10, extra_body=ONE_STEP)
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json)))) for item in ten.data]
    assert len(images) == 10 and all(image.shape == (16, 16, 3) for image in images)
    assert not np.array_equal(images[0], images[1])  # image i has seed + i
    assert "less than or equal to 10" in _refused(url, "n", "/v1/images/generations", json={"prompt": "x", "n": 11})
    monkeypatch.setattr(srv.served.admission, "max_queue", 4)
    assert "--max-queue" in _refused(url, "n", "/v1/images/generations", json={"prompt": "x", "n": 5})
    assert srv.served.admission.reserved_bytes == 0


def test_size_auto_is_the_card_default(server):
    _, url = server
    image = client(url).images.generate(prompt="a fox", size="auto", extra_body=ONE_STEP)
    assert image.size == "64x64" and Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json))).size == (64, 64)


def test_openai_rendering_fields_are_accepted_logged_and_echoed(server, caplog):
    _, url = server
    with caplog.at_level(logging.INFO, logger="fvgraph.serving"):
        image = client(url).images.generate(prompt="a fox", size="32x32", quality="high", style="vivid", user="u-1",
                                            background="transparent", moderation="low", extra_body=ONE_STEP)  # fmt: skip
    assert image.quality == "high" and image.background == "opaque"  # what was rendered: no alpha channel
    assert image.size == "32x32" and image.output_format == "png"
    assert any("'quality': 'high'" in r.getMessage() and "'user': 'u-1'" in r.getMessage() for r in caplog.records)
    assert "should be 'auto'" in _refused(url, "quality", "/v1/images/generations", json={"prompt": "x", "quality": "ultra"})
    assert "streams no partial images" in _refused(url, "stream", "/v1/images/generations", json={"prompt": "x", "stream": True})


def test_the_images_response_has_an_id_and_created(server):
    _, url = server
    result = client(url).images.generate(prompt="a fox", size="16x16", extra_body=ONE_STEP)
    assert result.id.startswith("img_") and result.created > 0  # SGLang's test reads result.id


# -- the peers' extension fields ------------------------------------------------------------------


def test_vllm_omni_form_fields_render_as_the_sdk_request_with_the_same_values(server):
    _, url = server
    form = {"prompt": "a fox", "width": "32", "height": "32", "num_frames": "5", "fps": "8", "negative_prompt": "blur",
            "num_inference_steps": "1", "guidance_scale": "4.0", "seed": "7", "user": "u-2"}  # as vLLM-Omni's curl sends it
    made = _post(url, "/v1/videos", files={name: (None, value) for name, value in form.items()}).json()
    assert made["size"] == "32x32" and made["num_frames"] == 5 and made["seconds"] == "0.625"
    same = client(url).videos.create(prompt="a fox", size="32x32", extra_body={
        "num_frames": 5, "fps": 8, "negative_prompt": "blur", "num_inference_steps": 1, "guidance_scale": 4.0, "seed": 7})
    other = client(url).videos.create(prompt="a fox", size="32x32", extra_body={
        "num_frames": 5, "fps": 8, "negative_prompt": "blur", "num_inference_steps": 1, "guidance_scale": 1.0, "seed": 7})
    frames = _video(url, made["id"])
    assert frames.shape == (5, 32, 32, 3) and np.array_equal(frames, _video(url, same.id))
    assert not np.array_equal(frames, _video(url, other.id))  # guidance_scale reached the request


def test_width_and_height_agreeing_with_size_are_served_and_conflicting_ones_are_refused(server):
    _, url = server
    image = _post(url, "/v1/images/generations", json={"prompt": "a fox", "size": "48x32", "width": 48, **ONE_STEP}).json()
    assert image["size"] == "48x32"
    message = _refused(url, "height", "/v1/images/generations", json={"prompt": "x", "size": "48x32", "height": 48})
    assert "height=48 conflicts with size='48x32'" in message


def test_flow_shift_and_boundary_ratio_are_refused_as_deploy_time_choices(server):
    _, url = server
    message = _refused(url, "flow_shift", data={"prompt": "x", "flow_shift": "5.0"})  # vLLM-Omni's form sends it
    assert "deploy-time" in message and "--flow-shift" in message and "flow_shift=3" in message
    assert "--boundary-ratio" in _refused(url, "boundary_ratio", data={"prompt": "x", "boundary_ratio": "0.875"})
    with pytest.raises(openai.BadRequestError, match="extra_params.flow_shift: is a deploy-time choice"):
        client(url).videos.create(prompt="x", extra_body={"extra_params": {"flow_shift": 5.0}})


def test_extra_params_keys_are_read_as_the_extension_fields(server):
    _, url = server
    api = client(url)
    nested = api.images.generate(prompt="a fox", size="16x16", extra_body={"extra_params": {"num_inference_steps": 1, "seed": 5}})
    top = api.images.generate(prompt="a fox", size="16x16", extra_body={"num_inference_steps": 1, "seed": 5})
    assert nested.data[0].b64_json == top.data[0].b64_json
    form = _post(url, "/v1/videos", data={"prompt": "a fox", "size": "16x16", "extra_params[num_frames]": "1",
                                          "extra_params[num_inference_steps]": "1"}).json()  # fmt: skip
    assert form["num_frames"] == 1 and _video(url, form["id"]).shape == (1, 16, 16, 3)
    message = _refused(url, "extra_params", json={"prompt": "x", "extra_params": {"colour": "red"}})
    assert message.startswith("extra_params.colour: is not a field extra_params takes here")
    assert _refused(url, "extra_params", json={"prompt": "x", "extra_params": {"seed": -1}}).startswith("extra_params.seed:")
    assert "send it once" in _refused(url, "extra_params", json={"prompt": "x", "seed": 1, "extra_params": {"seed": 2}})


def test_a_field_nobody_defines_is_refused_naming_it(server):
    _, url = server
    assert "unknown field" in _refused(url, "colour", json={"prompt": "x", "colour": "red"})
    with pytest.raises(openai.BadRequestError, match="sampler: unknown field"):
        client(url).images.generate(prompt="x", extra_body={"sampler": "euler"})


def test_frame_counts_off_the_4k_plus_1_rule_are_rounded_and_reported(server):
    _, url = server
    made = _post(url, "/v1/videos", json={"prompt": "a fox", "size": "16x16", "num_frames": 32, "fps": 16, **ONE_STEP}).json()
    assert made["num_frames"] == 33 and made["seconds"] == "2.0625"  # vLLM-Omni's 32: the nearest 4k+1 is 33
    assert _video(url, made["id"]).shape[0] == 33
    message = _refused(url, "num_frames", json={"prompt": "a fox", "num_frames": 80})  # past tiny-wan's 33
    assert "81 exceeds" in message and "num_frames=80 was rounded to 81" in message
    tie = client(url).videos.create(prompt="a fox", size="16x16", extra_body={"num_frames": 3, **ONE_STEP})
    assert tie.num_frames == 5  # halfway between 1 and 5: up
    client(url).videos.delete(tie.id)


def test_sizes_are_read_case_and_space_insensitively(server):
    _, url = server
    for size in ("48X32", " 48 x 32 "):
        image = _post(url, "/v1/images/generations", json={"prompt": "a fox", "size": size, **ONE_STEP}).json()
        assert image["size"] == "48x32"
        assert Image.open(io.BytesIO(base64.b64decode(image["data"][0]["b64_json"]))).size == (48, 32)
    assert "WIDTHxHEIGHT" in _refused(url, "size", json={"prompt": "x", "size": "48 by 32"})


def test_every_error_names_the_field_the_client_sent(server):
    _, url = server
    assert "sets the request's width" in _refused(url, "size", data={"prompt": "x", "size": "40x32"})
    assert "sets the request's num_frames" in _refused(url, "seconds", data={"prompt": "x", "seconds": "60"})  # 961 frames
    assert "sets the request's height" in _refused(url, "size", "/v1/images/generations", json={"prompt": "x", "size": "16x2000"})
    assert "width=40 must be a multiple of 16" in _refused(url, "width", json={"prompt": "x", "width": 40})
    assert "num_frames" in _refused(url, "num_frames", json={"prompt": "x", "num_frames": 1000})


# -- model names ----------------------------------------------------------------------------------


def test_model_names_are_the_card_id_the_aliases_and_the_checkpoint(server, tmp_path):
    _, url = server
    api = client(url)
    for name in ("tiny-wan", "sora-2", REPO_ID, REPO_ID.split("/")[1]):
        made = api.videos.create(prompt="a fox", model=name, size="16x16", extra_body={"num_frames": 1, **ONE_STEP})
        assert made.model == name
    with pytest.raises(openai.BadRequestError, match="'gpt-image-1' is not served here") as refused:
        api.images.generate(prompt="x", model="gpt-image-1")
    assert refused.value.body["param"] == "model"
    assert [model.id for model in api.models.list()] == ["tiny-wan", "sora-2", "Wan2.1-T2V-1.3B-Diffusers"]
    listed = api.models.retrieve(REPO_ID)
    assert listed.object == "model" and listed.owned_by == "fvgraph" and listed.created > 0
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-image-1")
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    with pytest.raises(ValueError, match="--served-model-name"):
        ServedNames.of("tiny-wan", ["two words"])
    hub = tmp_path / "hub" / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers" / "snapshots" / "0123abcd"  # as huggingface_hub lays it out
    hub.mkdir(parents=True)
    assert ServedNames.of("tiny-wan", checkpoint=hub).listed == ["tiny-wan", REPO_ID]
    assert not ServedNames.of("tiny-wan", checkpoint=hub).accepts("Other/Wan2.1-T2V-1.3B-Diffusers")
