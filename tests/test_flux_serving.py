"""tiny-flux through the user-facing surfaces: `fvgraph generate` writes a PNG, `fvgraph warmup`
prepares its buckets, `fvgraph parity` runs one-frame requests, and the official openai client's images.generate(model="tiny-flux", n=2) gets
the two images the engine makes for those seeds."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from http_helpers import client, live_server
from PIL import Image
from typer.testing import CliRunner

from fvgraph.cli import app
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.serving.model_names import ServedNames


def test_generate_writes_a_png(tmp_path):
    out = tmp_path / "fox.png"
    result = CliRunner().invoke(app, ["generate", "-O0", "--card", "tiny-flux", "-p", "a red fox", "-o", str(out), "--steps", "2", "--seed", "3"])
    assert result.exit_code == 0, result.output
    image = Image.open(out)
    assert image.format == "PNG" and image.size == (64, 64)
    [direct] = Engine.from_card("tiny-flux", device="cpu").generate([Request(prompt="a red fox", num_inference_steps=2, seed=3)])
    assert np.array_equal(np.asarray(image), direct.images[0])
    refused = CliRunner().invoke(app, ["generate", "--card", "tiny-wan", "-p", "x", "-o", str(tmp_path / "v.png"), "--steps", "1"])
    assert refused.exit_code != 0 and "an image file holds one frame" in refused.output


def test_warmup_prepares_the_flux_buckets(tmp_path):
    result = CliRunner().invoke(app, ["warmup", "--card", "tiny-flux", "-O", "1", "--compile-backend", "aot_eager",
                                      "--buckets", "1,2", "--cache-dir", str(tmp_path / "cache"), "--steps", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()  # each compile announced as it starts, largest bucket first, then its seconds
    assert [line for line in lines if line.startswith("compiling ") and line.endswith(" ...")] == [
        "compiling denoise, batch bucket 2 ...", "compiling denoise, batch bucket 1 ..."]
    assert sum(line.startswith("compiling denoise, batch bucket ") and ": done in " in line for line in lines) == 2
    # and the capture cache holds them: one denoise entry per bucket, for this card, whose files are there
    from fvgraph.compile.capture_cache import CacheEntry, CaptureCache

    [folder] = [d for d in (tmp_path / "cache").iterdir() if d.is_dir()]
    cache = CaptureCache.open_existing(folder)
    entries = [CacheEntry(key, entry) for key, entry in cache.entries().items()]
    assert sorted([e.record["factors"][k] for k in ("card_id", "step_kind", "batch")] for e in entries) == [
        ["tiny-flux", "denoise", 1], ["tiny-flux", "denoise", 2]]
    assert all(cache.check(e) is None for e in entries), [cache.check(e) for e in entries]


def test_parity_runs_on_an_image_card_with_one_frame():
    result = CliRunner().invoke(app, ["parity", "--card", "tiny-flux", "-O", "1", "--compile-backend", "aot_eager", "--steps", "2"])
    assert result.exit_code == 0, result.output
    assert "passed" in result.output


@pytest.fixture(scope="module")
def flux_server(tmp_path_factory):
    engine = Engine.from_card("tiny-flux", device="cpu")
    with live_server(engine, tmp_path_factory.mktemp("flux-http"), model_names=ServedNames.of("tiny-flux", [])) as (srv, url):
        yield engine, url


def test_openai_images_generate_n_2_gets_the_engines_two_images(flux_server):
    _, url = flux_server
    engine = Engine.from_card("tiny-flux", device="cpu")  # the served one is driven by the server's thread
    response = client(url).images.generate(model="tiny-flux", prompt="a red fox", n=2, size="64x48",
                                           extra_body={"num_inference_steps": 2, "seed": 5, "guidance_scale": 4.0})  # fmt: skip
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json)))) for item in response.data]
    assert len(images) == 2 and all(image.shape == (48, 64, 3) for image in images)
    for i, image in enumerate(images):  # image i has seed + i
        [direct] = engine.generate([Request(prompt="a red fox", num_inference_steps=2, seed=5 + i, guidance_scale=4.0, width=64, height=48)])
        assert np.array_equal(image, direct.images[0])
    assert not np.array_equal(images[0], images[1])
    true_cfg = client(url).images.generate(model="tiny-flux", prompt="a fox", size="32x32",
                                           extra_body={"num_inference_steps": 1, "true_cfg_scale": 3.0, "negative_prompt": "dark"})  # fmt: skip
    assert len(true_cfg.data) == 1
