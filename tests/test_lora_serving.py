"""LoRA adapters over HTTP (the admin endpoints and a request body's `loras`, for videos and images)
and on the CLI (--lora)."""

import base64
import io
import time

import numpy as np
import pytest
import torch
from http_helpers import KEY, QUICK, client, expected_video, httpx, live_server
from PIL import Image
from typer.testing import CliRunner

from fvgraph.adapters.setup import LoraFile
from fvgraph.adapters.slots import LoraSlots
from fvgraph.cli import app
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.serving.media_encode import decode_mp4
from fvgraph.serving.model_names import ServedNames
from lora_files import ATTENTION, peft_lora

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks the videos API deprecated
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def lora_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return peft_lora(d / "a", 1, ["to_q", "to_k", "to_v", "to_out.0"]), peft_lora(d / "kv", 3, ["attn2.to_k", "attn2.to_v"])


def test_adapters_are_loaded_chosen_and_unloaded_over_http(lora_paths, tmp_path):
    a, kv = lora_paths
    engine = Engine.from_card("tiny-wan", device="cpu", loras={"a": a}, lora_slots=LoraSlots(2, 8, 2))
    folder = kv.parent.parent  # the adapter directory: paths are given relative to it
    with live_server(engine, tmp_path, lora_dir=folder) as (_, url):
        listed = httpx.get(url + "/v1/loras", headers=AUTH).json()["data"]
        assert [(x["name"], x["slot"]) for x in listed] == [("a", 0)] and "path" not in listed[0]
        assert httpx.get(url + "/v1/loras").status_code == 401  # under the API key
        loaded = httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "kv", "path": "kv/lora.safetensors"})
        assert loaded.status_code == 200 and loaded.json()["slot"] == 1
        full = httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "c", "path": "kv/lora.safetensors"})
        assert full.status_code == 400 and "all max_loras=2 slots" in full.json()["error"]["message"]
        missing = httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "d", "path": "none.safetensors"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "path"
        extra = httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "d", "path": "kv/lora.safetensors", "scale": 1})
        assert extra.status_code == 400 and extra.json()["error"]["param"] == "scale"

        api = client(url)
        chosen = {"loras": {"a": 0.7, "kv": 1.0}}
        video = api.videos.create_and_poll(prompt="a fox", size="32x32", seconds="1", poll_interval_ms=20, extra_body={**QUICK, **chosen})
        assert video.status == "completed", video.error
        frames = decode_mp4(api.videos.download_content(video.id).read())
        direct = Engine.from_card("tiny-wan", device="cpu", loras={"a": a, "kv": kv}, lora_slots=LoraSlots(2, 8, 2))
        expected = expected_video(direct, fps=4, prompt="a fox", height=32, width=32, num_frames=5, num_inference_steps=2,
                                  seed=1, loras=chosen["loras"])  # fmt: skip
        assert np.array_equal(frames, expected)
        base = expected_video(direct, fps=4, prompt="a fox", height=32, width=32, num_frames=5, num_inference_steps=2, seed=1)
        assert not np.array_equal(frames, base)

        with pytest.raises(Exception) as refused:
            api.videos.create(prompt="a fox", size="32x32", seconds="1", extra_body={**QUICK, "loras": {"nope": 1.0}})
        assert refused.value.status_code == 400 and "unknown lora 'nope'" in str(refused.value)
        assert refused.value.body["param"] == "loras"

        gone = httpx.delete(url + "/v1/loras/kv", headers=AUTH)
        assert gone.status_code == 200 and gone.json() == {"object": "lora.deleted", "name": "kv", "deleted": True}
        assert httpx.delete(url + "/v1/loras/kv", headers=AUTH).status_code == 404
        assert [x["name"] for x in httpx.get(url + "/v1/loras", headers=AUTH).json()["data"]] == ["a"]


def test_an_image_request_chooses_its_adapters_in_the_body(tmp_path):
    style = peft_lora(tmp_path / "style", 5, ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj"], card="tiny-flux")
    engine = Engine.from_card("tiny-flux", device="cpu", loras={"style": style}, lora_slots=LoraSlots(2, 8, 2))
    direct = Engine.from_card("tiny-flux", device="cpu", loras={"style": style}, lora_slots=LoraSlots(2, 8, 2))
    args = dict(prompt="a red fox", num_inference_steps=2, seed=5, width=32, height=32)
    with live_server(engine, tmp_path, model_names=ServedNames.of("tiny-flux", [])) as (_, url):
        response = client(url).images.generate(model="tiny-flux", prompt="a red fox", size="32x32",
                                               extra_body={"num_inference_steps": 2, "seed": 5, "loras": {"style": 0.8}})  # fmt: skip
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))))
        with pytest.raises(Exception) as refused:
            client(url).images.generate(model="tiny-flux", prompt="a fox", size="32x32", extra_body={"loras": {"nope": 1.0}})
    [adapted, base] = direct.generate([Request(loras={"style": 0.8}, **args), Request(**args)])
    assert np.array_equal(image, adapted.images[0]) and not np.array_equal(image, base.images[0])
    assert refused.value.status_code == 400 and refused.value.body["param"] == "loras"


def test_generate_takes_lora_and_lora_scale(lora_paths, tmp_path):
    a, _ = lora_paths
    runner = CliRunner()
    common = ["generate", "-O0", "--frames", "5", "--height", "32", "--width", "32", "--steps", "2", "--seed", "1"]
    plain = runner.invoke(app, [*common, "-o", str(tmp_path / "plain.gif")])
    adapted = runner.invoke(app, [*common, "--lora", f"a={a}", "--lora-scale", "a=0.7", "-o", str(tmp_path / "a.gif")])
    assert plain.exit_code == 0 and adapted.exit_code == 0, adapted.output
    assert (tmp_path / "plain.gif").read_bytes() != (tmp_path / "a.gif").read_bytes()
    bad = runner.invoke(app, [*common, "--lora", "a", "-o", str(tmp_path / "bad.gif")])
    assert bad.exit_code == 2 and "--lora='a' must be NAME=PATH" in bad.output
    unknown = runner.invoke(app, [*common, "--lora", f"a={a}", "--lora-scale", "b=1", "-o", str(tmp_path / "bad.gif")])
    assert unknown.exit_code == 2 and "'b' is not a --lora adapter" in unknown.output


def test_over_http_adapters_load_only_from_the_adapter_directory(lora_paths, tmp_path):
    """Issue 51's fault 9: no file outside --lora-dir is opened, and outside and missing get one answer."""
    a, kv = lora_paths
    folder = kv.parent.parent
    (folder / "link.safetensors").unlink(missing_ok=True)
    (folder / "link.safetensors").symlink_to("/etc/hostname")  # inside by name, outside once resolved
    engine = Engine.from_card("tiny-wan", device="cpu", lora_slots=LoraSlots(2, 8, 2))
    with live_server(engine, tmp_path / "no-dir") as (_, url):
        refused = httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "kv", "path": "kv/lora.safetensors"})
        assert refused.status_code == 403 and "--lora-dir" in refused.json()["error"]["message"]
    with live_server(engine, tmp_path / "dir", lora_dir=folder) as (_, url):
        answers = {}
        for path in ("/etc/hostname", "../../../../etc/hostname", "/etc/no-such-file", "link.safetensors",
                     "none.safetensors", "x" * 300 + ".safetensors"):  # fmt: skip
            answer = httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "z", "path": path})
            assert answer.status_code == 404 and answer.json()["error"]["param"] == "path", (path, answer.text)
            answers[path] = answer.json()["error"]["message"].replace(repr(path[:200]), "PATH")
        assert len(set(answers.values())) == 1  # existing or not, outside or missing: the same words
        assert httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "z", "path": "x" * 5000}).status_code == 400
        assert engine.loras() == []


def test_a_remix_is_refused_when_its_adapter_name_now_holds_another_file(lora_paths, tmp_path):
    """Issue 51's fault 13: a video records each adapter's digest; a remix after the name was unloaded
    and another file loaded under it is a 409 naming the adapter, not a render with the other file."""
    a, kv = lora_paths
    folder = kv.parent.parent
    engine = Engine.from_card("tiny-wan", device="cpu", lora_slots=LoraSlots(2, 8, 2))
    with live_server(engine, tmp_path, lora_dir=folder) as (_, url):
        assert httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "style", "path": "kv/lora.safetensors"}).status_code == 200
        api = client(url)
        video = api.videos.create_and_poll(prompt="a fox", size="32x32", seconds="1", poll_interval_ms=20,
                                           extra_body={**QUICK, "loras": {"style": 1.0}})  # fmt: skip
        assert video.status == "completed", video.error
        again = httpx.post(url + f"/v1/videos/{video.id}/remix", headers=AUTH, json={"prompt": "a cat"})
        assert again.status_code == 200, again.text  # the same file under the name: the remix runs
        while api.videos.retrieve(again.json()["id"]).status in ("queued", "in_progress"):  # unloading waits for no request
            time.sleep(0.02)
        assert httpx.delete(url + "/v1/loras/style", headers=AUTH).status_code == 200
        assert httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "style", "path": "a/lora.safetensors"}).status_code == 200
        refused = httpx.post(url + f"/v1/videos/{video.id}/remix", headers=AUTH, json={"prompt": "a cat"})
        assert refused.status_code == 409 and refused.json()["error"]["param"] == "loras"
        assert "lora 'style'" in refused.json()["error"]["message"]


def test_over_http_an_adapter_loads_into_the_expert_the_body_names(tmp_path):
    """POST /v1/loras `expert`: diffusers' names of a two-expert card's denoisers, the high-noise one
    by default; the result equals the engine given the same files per expert at build (which
    tests/test_lora_experts.py checks against diffusers' `load_into_transformer_2`)."""
    card, folder = "tiny-wan2.2-a14b", tmp_path / "loras"
    hi = peft_lora(folder / "hi", 1, ATTENTION, rank=4, alpha=8.0, card=card)
    lo = peft_lora(folder / "lo", 2, ["attn1.to_q", "attn2.to_v", "ffn.net.0.proj"], rank=4, alpha=4.0, card=card)
    slots = LoraSlots(max_loras=3, max_lora_rank=8, max_loras_per_request=2)
    engine = Engine.from_card(card, device="cpu", lora_slots=slots)
    with live_server(engine, tmp_path, lora_dir=folder) as (_, url):
        post = lambda **body: httpx.post(url + "/v1/loras", headers=AUTH, json=body)  # noqa: E731
        bad = post(name="lo", path="lo/lora.safetensors", expert="transformer_3")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "expert", bad.text
        assert "transformer_2" in bad.json()["error"]["message"] and engine.loras() == []
        assert post(name="lo", path="lo/lora.safetensors", expert="transformer_2").json()["expert"] == "transformer_2"
        assert post(name="hi", path="hi/lora.safetensors").json()["expert"] == "transformer"  # the default
        listed = httpx.get(url + "/v1/loras", headers=AUTH).json()["data"]
        assert [(x["name"], x["expert"]) for x in listed] == [("lo", "transformer_2"), ("hi", "transformer")]
    built = Engine.from_card(card, device="cpu", lora_slots=slots, loras={"hi": hi, "lo": LoraFile(lo, expert="transformer_2")})
    positive, negative = (torch.randn(16, engine.facts.text_dim, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    request = Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=4.0, guidance_scale_2=3.0, seed=7,
                      height=32, width=32, num_frames=5, num_inference_steps=4, output_type="latent", loras={"hi": 0.7, "lo": 0.5})
    [served], [expected] = engine.generate([request]), built.generate([request])
    assert served.ok and expected.ok, (served.error, expected.error)
    assert torch.equal(served.latents, expected.latents)
    [base] = built.generate([request.model_copy(update={"loras": {"hi": 0.7}})])
    assert (base.latents - expected.latents).abs().max() > 0.01  # the low-noise adapter reaches the low-noise steps

    one = Engine.from_card("tiny-wan", device="cpu", lora_slots=slots)
    with live_server(one, tmp_path / "one", lora_dir=folder) as (_, url):
        refused = httpx.post(url + "/v1/loras", headers=AUTH, json={"name": "x", "path": "hi/lora.safetensors", "expert": "transformer"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "expert", refused.text
        assert "one denoiser" in refused.json()["error"]["message"] and one.loras() == []
