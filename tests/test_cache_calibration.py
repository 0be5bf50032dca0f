"""`fvgraph calibrate`: MagCache's ratios measured on the loaded weights equal diffusers' calibration mode
on the same weights, are stored per weights, and fill a request that names the method without them."""

import pytest
import torch
from diffusers import WanPipeline
from diffusers.hooks import MagCacheConfig
from diffusers.hooks.mag_cache import MagCacheBlockHook
from typer.testing import CliRunner

from fvgraph.card import ModelCard
from fvgraph.cli import app
from fvgraph.caching.calibration_store import CalibrationStore
from fvgraph.engine.calibrate import calibrate
from fvgraph.models.components import diffusers_scheduler
from fvgraph.request import Request, RequestRejected
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from conftest import embeds

STEPS = 6
SHAPE = {"height": 64, "width": 64, "num_frames": 9}


def _diffusers_calibration(card, positive, negative, monkeypatch) -> list[list[float]]:
    """The ratios MagCacheConfig(calibrate=True) measures, per cache context in first-seen order (cond, uncond)."""
    c = load_components(card, None, torch.device("cpu"))  # the same weights, nothing of fvgraph in them
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip
    pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    measured: dict[int, list[float]] = {}
    original = MagCacheBlockHook._perform_calibration_step

    def record(hook, state, residual):  # diffusers only prints the list and resets it at the last step
        original(hook, state, residual)
        measured[id(state)] = list(state.calibration_ratios)

    monkeypatch.setattr(MagCacheBlockHook, "_perform_calibration_step", record)
    pipe(prompt_embeds=positive[None], negative_prompt_embeds=negative[None], guidance_scale=5.0, num_inference_steps=STEPS,
         generator=torch.Generator().manual_seed(3), output_type="latent", **SHAPE)  # fmt: skip
    return list(measured.values())


def test_calibrated_ratios_equal_diffusers_calibration_and_serve_a_request(tiny_engine, tmp_path, monkeypatch):
    card = tiny_engine.card
    positive, negative = (e[0] for e in embeds(3, card))
    store = CalibrationStore(tmp_path)
    record, path = calibrate(tiny_engine, "magcache", STEPS, seed=3, store=store, prompt_embeds=positive,
                             negative_prompt_embeds=negative, guidance_scale=5.0, **SHAPE)  # fmt: skip
    cond, uncond = _diffusers_calibration(card, positive, negative, monkeypatch)
    ours = record["values"]["mag_ratios"]
    assert len(ours) == STEPS and ours[0] == 1.0 and ours != [1.0] * STEPS
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(cond), atol=1e-5, rtol=1e-5)  # the cond context's
    assert cond != uncond  # which branch is measured matters
    assert path == tmp_path / "tiny-wan" / tiny_engine.loop.components.weights_version / "magcache.json"

    engine = Engine.from_card(card, device="cpu", calibration_dir=tmp_path)  # a new process: finds them on disk
    request = Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=1, output_type="latent",
                      num_inference_steps=STEPS, cache="magcache:threshold=0.5", **SHAPE)  # fmt: skip
    resolved = engine.loop.check_request(request)
    assert resolved.cache.mag_ratios == tuple(ours) and resolved.cache.threshold == 0.5
    [result] = engine.generate([request])
    assert result.ok and result.cache["computed"] + result.cache["reused"] == 2 * STEPS

    other = ModelCard.model_validate({**card.model_dump(), "seed": 7})  # other weights: their own fingerprint
    with pytest.raises(RequestRejected, match=r"cache.mag_ratios: not given, and none calibrated for card 'tiny-wan' with weights"):
        Engine.from_card(other, device="cpu", calibration_dir=tmp_path).loop.check_request(request)


def test_the_calibrate_command_stores_where_generate_finds_them(tmp_path):
    runner = CliRunner()
    cache_dir = tmp_path / "cc"
    result = runner.invoke(app, ["calibrate", "--steps", "3", "--frames", "1", "--cache-dir", str(cache_dir)])
    assert result.exit_code == 0, result.output
    assert "mag_ratios: [1.0000, " in result.output
    [stored] = (cache_dir / "calibration" / "tiny-wan").glob("*/magcache.json")
    generated = runner.invoke(app, ["generate", "-O0", "-p", "a fox", "--steps", "3", "--frames", "1", "--cache", "magcache",
                                    "--cache-dir", str(cache_dir), "-o", str(tmp_path / "v.gif")])  # fmt: skip
    assert generated.exit_code == 0, generated.output
    assert "cache magcache: " in generated.output
    bad = runner.invoke(app, ["calibrate", "--steps", "3", "--method", "fbcach", "--cache-dir", str(cache_dir)])
    assert bad.exit_code == 2 and "method='fbcach' is not a known cache method" in bad.output
    assert stored.is_file()
