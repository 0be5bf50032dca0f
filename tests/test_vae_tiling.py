"""Tiled VAE decode and encode, one step per tile, equal to diffusers' own tiled decode and encode.

The reference is diffusers' VAE on an untouched copy of the same weights after
`vae.enable_tiling(**same)`; at these shapes the untiled result differs by far more than any
tolerance, so each check can fail. Tiles are steps: other requests' steps run between them, a
request equals itself run alone, and a cancel lands between two tiles.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import WanPipeline
from PIL import Image

from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.contract.phase import Phase
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request, RequestRejected
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.serving.admission import Admission
from fvgraph.serving.memory_reservation import VAE_CPU_FIXED_BYTES, MemoryModel
from conftest import embeds

WAN_TILES = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_sample_stride_height": 24, "tile_sample_stride_width": 24}
TI2V_TILES = {"tile_sample_min_height": 48, "tile_sample_min_width": 48, "tile_sample_stride_height": 32, "tile_sample_stride_width": 32}
# HunyuanVideo-1.5's VAE (spatial ratio 16): 64 x 96 pixels are 4 x 6 latents, decoded in tiles of 2
# latents every 1 and encoded in tiles of 32 pixels every 16 (4 x 6 tiles either way: diffusers starts
# a window at every stride).
HV15_TILES = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_latent_min_height": 2, "tile_latent_min_width": 2,
              "tile_overlap_factor": 0.5}  # fmt: skip
SHAPE = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def tiled_wan():
    return Engine.from_card("tiny-wan", device="cpu", vae_tiling=WAN_TILES)


def _uint8(video: torch.Tensor) -> np.ndarray:
    """[1, 3, F, H, W] in [-1, 1] -> frames as the engine returns them (the pipeline's postprocess, rounded)."""
    frames = (video / 2 + 0.5).clamp(0, 1)[0].permute(1, 2, 3, 0).float()
    return (frames * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def _diffusers_decode(card: str, latents: torch.Tensor, tiles: dict | None) -> torch.Tensor:
    """The pipeline's decode of the engine's final latents on an untouched VAE (tiled as `tiles`, None: untiled)."""
    vae = load_components(get_card(card), None, torch.device("cpu")).vae
    if tiles is not None:
        vae.enable_tiling(**tiles)
    if getattr(vae.config, "latents_mean", None) is not None:  # Wan, Qwen-Image: the pipelines denormalize per channel
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        z = latents / (1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)) + mean
    elif "hunyuan" in card:  # HunyuanVideo-1.5: scaling alone, every frame
        z = latents / vae.config.scaling_factor
    else:  # FLUX: scaling and shift, on the one frame
        z = latents[:, :, 0] / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    with torch.no_grad():
        video = vae.decode(z, return_dict=False)[0]
    return video if video.dim() == 5 else video.unsqueeze(2)


def _frames(result) -> np.ndarray:
    return result.frames if result.frames is not None else result.images


@pytest.mark.parametrize("card, tiles", [("tiny-wan", WAN_TILES), ("tiny-wan2.2-ti2v", TI2V_TILES), ("tiny-flux", True),
                                         ("tiny-qwen-image", WAN_TILES), ("tiny-hunyuanvideo1.5", HV15_TILES)])  # fmt: skip
def test_tiled_decode_equals_diffusers_tiled_decode(card, tiles):
    engine = Engine.from_card(card, device="cpu", vae_tiling=tiles)
    video_card = "wan" in card or "hunyuan" in card
    shape = SHAPE if video_card else {k: v for k, v in SHAPE.items() if k != "num_frames"}
    [result] = engine.generate([Request(prompt="a red fox in fresh snow", seed=5, **shape)])
    assert result.ok, result.error
    assert result.timings["vae_decode"] > 0
    same = {} if tiles is True else tiles
    expected = _uint8(_diffusers_decode(card, result.latents, same))
    assert np.array_equal(_frames(result).reshape(expected.shape), expected)
    untiled = _uint8(_diffusers_decode(card, result.latents, None))
    assert np.abs(untiled.astype(int) - expected.astype(int)).max() > 10  # so the equality above can fail


def test_a_tiled_decode_runs_one_step_per_tile_and_matches_the_wan_pipeline(tiled_wan):
    """Through diffusers' WanPipeline with `pipe.vae.enable_tiling(**same)`, from text embeddings to frames."""
    c = load_components(get_card("tiny-wan"), None, torch.device("cpu"))
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(tiled_wan.card.recipe.sampler))  # fmt: skip
    pipe.vae.enable_tiling(**WAN_TILES)
    positive, negative = embeds(21, tiled_wan.card)
    video = pipe(prompt_embeds=positive, negative_prompt_embeds=negative, generator=torch.Generator().manual_seed(4),
                 output_type="np", **SHAPE).frames[0]  # fmt: skip
    kinds = []
    state = tiled_wan.start(Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=4, **SHAPE))
    while state.phase != Phase.DONE:
        kinds.append(tiled_wan.loop.next(state).kind)
        tiled_wan.step(state)
    # 8 x 12 latents in tiles of 4 every 3: 3 rows x 4 columns
    assert kinds.count("vae_decode_tile") == 12 and "vae_decode" not in kinds
    frames = tiled_wan.finish(state).frames
    expected = (video * 255).round()
    assert np.abs(frames.astype(float) - expected).max() <= 1  # a uint8 step covers the denoise loop's fp32 noise


def _encoded_in_tiles(card: str, tiles: dict) -> tuple[Engine, Image.Image, object, list[str]]:
    """A 64 x 96 image-to-video request on `card` tiled as `tiles`, run up to its first denoise step:
    the engine, the image, the state and the step kinds that ran (the encode in tiles, then its end)."""
    engine = Engine.from_card(card, device="cpu", vae_tiling=tiles)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    state = engine.start(Request(prompt="a fox", image=image, seed=1, **SHAPE))
    kinds = []
    while state.phase != Phase.DENOISE:
        kinds.append(engine.loop.next(state).kind)
        engine.step(state)
    assert kinds[-1] == "vae_encode_end" and "vae_encode" not in kinds
    return engine, image, state, kinds


@pytest.mark.parametrize("card, tiles", [("tiny-wan-i2v", WAN_TILES), ("tiny-wan2.2-ti2v", TI2V_TILES)])
def test_tiled_encode_equals_diffusers_tiled_encode(card, tiles):
    from diffusers.video_processor import VideoProcessor

    engine, image, state, kinds = _encoded_in_tiles(card, tiles)
    assert kinds.count("vae_encode_tile") > 1
    vae = load_components(get_card(card), None, torch.device("cpu")).vae
    pixels = VideoProcessor(vae_scale_factor=engine.facts.vae_spatial).preprocess(image, height=64, width=96).float()
    frames = SHAPE["num_frames"] if card == "tiny-wan-i2v" else 1  # Wan 2.1 I2V encodes the image then zero frames
    video = torch.cat([pixels.unsqueeze(2), pixels.new_zeros(1, 3, frames - 1, 64, 96)], dim=2)

    def encoded(tiled: bool) -> torch.Tensor:
        vae.enable_tiling(**tiles) if tiled else vae.disable_tiling()
        with torch.no_grad():
            mode = vae.encode(video).latent_dist.mode()
        mean, std = (torch.tensor(getattr(vae.config, k)).view(1, -1, 1, 1, 1) for k in ("latents_mean", "latents_std"))
        return (mode.float() - mean) * (1.0 / std)

    expected = encoded(tiled=True)
    ours = state.condition[:, -expected.shape[1] :]  # I2V puts the first-frame mask before the latents
    assert torch.equal(ours, expected)
    assert (encoded(tiled=False) - expected).abs().max() > 1e-2


def test_hunyuan_video15_tiled_encode_equals_diffusers_tiled_encode():
    """The image-to-video card's image, encoded as one frame in tiles (the pipeline's video processor,
    then `vae.encode(...).latent_dist.mode()` times the scaling factor, on frame 0 of `condition`)."""
    from fvgraph.loops.hunyuan_video15_image import image_processor

    card = "tiny-hunyuanvideo1.5-i2v"
    engine, image, state, kinds = _encoded_in_tiles(card, HV15_TILES)
    assert kinds.count("vae_encode_tile") == 4 * 6
    vae = load_components(get_card(card), None, torch.device("cpu")).vae
    pixels = image_processor(engine.facts.vae_spatial).preprocess(image, height=64, width=96).float().unsqueeze(2)

    def encoded(tiled: bool) -> torch.Tensor:
        vae.enable_tiling(**HV15_TILES) if tiled else vae.disable_tiling()
        with torch.no_grad():
            return vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor

    expected = encoded(tiled=True)
    assert torch.equal(state.condition[:, : expected.shape[1], :1], expected)
    assert (encoded(tiled=False) - expected).abs().max() > 1e-2


def _request(seed: int, steps: int = 2) -> Request:
    return Request(prompt=f"a fox, take {seed}", seed=seed, **{**SHAPE, "num_inference_steps": steps})


def test_tiles_interleave_with_other_requests_and_each_equals_itself_alone(tiled_wan):
    alone = {seed: tiled_wan.generate([_request(seed, steps)])[0] for seed, steps in ((1, 2), (2, 2), (3, 12))}
    batches = []
    run_batch = tiled_wan.executor.run_batch

    def recorded(plans, *args, **kwargs):
        batches.append(plans[0].kind)
        return run_batch(plans, *args, **kwargs)

    tiled_wan.executor.run_batch = recorded
    try:
        together = tiled_wan.generate([_request(1), _request(2), _request(3, steps=12)])
    finally:
        del tiled_wan.executor.run_batch
    for result in together:
        assert result.ok, result.error
        assert np.array_equal(result.frames, alone[result.seed].frames)
        assert torch.equal(result.latents, alone[result.seed].latents)
    # The third request's denoise steps ran between the first two requests' tiles.
    first_tile, last_tile = batches.index("vae_decode_tile"), len(batches) - 1 - batches[::-1].index("vae_decode_tile")
    assert any(kind.startswith("denoise") for kind in batches[first_tile:last_tile])


def test_a_cancel_lands_between_tiles_and_frees_the_request(tiled_wan):
    tiled_wan.submit(_request(7))
    other = tiled_wan.submit(_request(8))
    results = []
    while not results or all(r.request_id != other for r in results):
        results += tiled_wan.tick()
        states = {s.request_id: s for s in tiled_wan._live_states()}
        mine = [s for rid, s in states.items() if rid != other]
        if mine and mine[0].tiles is not None and mine[0].tiles.count >= 2:
            tiled_wan.cancel(mine[0].request_id)
    results += [r for r in tiled_wan.tick()] if tiled_wan.has_work() else []
    while tiled_wan.has_work():
        results += tiled_wan.tick()
    by_id = {r.request_id: r for r in results}
    assert by_id[other].ok
    [cancelled] = [r for rid, r in by_id.items() if rid != other]
    assert cancelled.status == "cancelled"
    assert tiled_wan.in_flight == 0


@pytest.mark.parametrize("card, option, words", [
    ("tiny-wan", {"tile_size": 64}, "unknown: tile_size"),
    ("tiny-wan", {"tile_sample_min_height": 30}, "multiple of the VAE's spatial compression ratio 8"),
    ("tiny-wan", {"tile_sample_stride_width": 512}, "must be <= tile_sample_min_width=256"),
    ("tiny-wan", "yes", "pass True"),
    ("tiny-hunyuanvideo1.5", {"tile_overlap_factor": 1.0}, "tile_overlap_factor=1.0: must be in [0, 1)"),
    ("tiny-hunyuanvideo1.5", {"tile_latent_min_width": 1, "tile_overlap_factor": 0.5}, "tile_latent_min_width=1: must be a whole number"),
])  # fmt: skip
def test_bad_tiling_settings_are_refused_naming_vae_tiling(card, option, words):
    with pytest.raises(ValueError, match="vae_tiling") as err:
        Engine.from_card(card, device="cpu", vae_tiling=option)
    assert words in str(err.value)


def test_flux_tiling_takes_no_settings():
    with pytest.raises(ValueError, match=r"vae_tiling: AutoencoderKL.enable_tiling takes no settings"):
        Engine.from_card("tiny-flux", device="cpu", vae_tiling={"tile_sample_min_height": 64})


PEAK_TILES = {"tile_sample_min_height": 128, "tile_sample_min_width": 128, "tile_sample_stride_height": 96, "tile_sample_stride_width": 96}


def _peak(side: str, tiling: dict | None) -> dict:
    """One fresh process per run: memory a decode freed stays with the allocator, so a second decode in
    the same process would grow it less."""
    extra = [] if tiling is None else [json.dumps(tiling if side == "diffusers" else {"vae_tiling": tiling})]
    args = [sys.executable, "-m", "fvgraph.perf.memory_worker", side, "tiny-wan", "5x256x256", *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["ok"], measured["error"]
    return measured


def test_a_tiled_decode_grows_resident_memory_far_less_and_admission_charges_the_tile():
    """Peak RSS growth of a decode-heavy request (5x256x256, one step, no CFG), tiled against untiled,
    beside diffusers' own decode at the same shape and tiles (both ratios printed; in two runs each
    here, fvgraph's were 0.46 and 0.48, diffusers' 0.38 and 0.52: the peak is the kernel's high-water mark)."""
    ours, ours_tiled = _peak("fvgraph", None), _peak("fvgraph", PEAK_TILES)
    theirs, theirs_tiled = _peak("diffusers", None), _peak("diffusers", PEAK_TILES)
    print(json.dumps({"fvgraph": ours_tiled["growth"] / ours["growth"], "diffusers": theirs_tiled["growth"] / theirs["growth"]}))
    assert ours_tiled["growth"] <= 0.7 * ours["growth"], (ours, ours_tiled)
    assert theirs_tiled["growth"] < theirs["growth"]  # the calibration: tiling shrinks diffusers' decode too
    # Admission charges the tile's working set and holds it to the measured peak, as for whole decodes
    # (tests/test_admission.py): at least the growth, at most 3x it plus the fixed part.
    assert "vae_tile_rows" in ours_tiled["parts"] and ours_tiled["estimate"] < ours["estimate"]
    assert ours_tiled["growth"] <= ours_tiled["estimate"] <= 3 * ours_tiled["growth"] + VAE_CPU_FIXED_BYTES, ours_tiled


def test_a_request_too_large_even_for_tiles_is_refused_naming_its_size(tiled_wan, tiny_engine):
    request = tiled_wan.loop.check_request(Request(prompt="big", num_frames=33, height=256, width=256, seed=0))
    untiled, tiled = MemoryModel(tiny_engine).estimate(request), MemoryModel(tiled_wan).estimate(request)
    assert tiled.parts["vae_decode"] < untiled.parts["vae_decode"]
    admission = Admission(MemoryModel(tiled_wan), budget_bytes=tiled.total // 2, max_queue=4, max_running=4)
    with pytest.raises(RequestRejected, match=r"memory_budget: this request \(33x256x256\) needs about") as err:
        admission.offer(request)
    assert "vae_tiling" not in str(err.value)  # it is on: the advice would not help
    with pytest.raises(RequestRejected, match="or serve with vae_tiling"):
        Admission(MemoryModel(tiny_engine), tiled.total // 2, max_queue=4, max_running=4).offer(request)


def test_compiled_tiled_engine_serves_a_second_wave_without_compiling():
    """-O1: the denoise steps compile, the tiles run eagerly between them; warmed up and frozen, a second
    wave of other seeds and step counts compiles nothing, and its frames are diffusers' tiled decode of its latents."""
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, vae_tiling=WAN_TILES,
                              compile_config=CompileConfig(backend="aot_eager"), buckets=BucketSpec(batch_sizes=(1, 2)))  # fmt: skip
    engine.warmup([_request(1)])
    engine.freeze()
    with engine.counters.expect(compiles=0):
        results = engine.generate([_request(11, steps=3), _request(12)])
    for result in results:
        assert result.ok, result.error
        assert np.array_equal(result.frames, _uint8(_diffusers_decode("tiny-wan", result.latents, WAN_TILES)))


def test_generate_tiles_with_the_flag_and_names_it_in_errors(tmp_path):
    from typer.testing import CliRunner

    from fvgraph.cli import app

    settings = ",".join(f"{key}={value}" for key, value in WAN_TILES.items())
    out = tmp_path / "fox.gif"
    args = ["generate", "tiny-wan", "-p", "a fox", "--steps", "1", "--frames", "5", "--width", "96", "-O0", "-o", str(out)]
    done = CliRunner().invoke(app, [*args, "--vae-tiling", settings])
    assert done.exit_code == 0, done.output
    with Image.open(out) as gif:
        assert gif.n_frames == 5 and gif.size == (96, 64)
    for bad, words in (("tile_size=3", "--vae-tiling: AutoencoderKLWan.enable_tiling takes"), ("tile_sample_min_height=a", "whole number")):
        refused = CliRunner().invoke(app, [*args, "--vae-tiling", bad])
        assert refused.exit_code == 2 and words in refused.output, refused.output


def test_the_flag_reads_an_overlap_factor_as_a_number_and_sizes_as_whole_numbers():
    from fvgraph.cli.options import parse_vae_tiling

    text = ",".join(f"{key}={value}" for key, value in HV15_TILES.items())
    assert parse_vae_tiling(text) == HV15_TILES and isinstance(parse_vae_tiling(text)["tile_overlap_factor"], float)
    with pytest.raises(ValueError, match=r"tile_overlap_factor='a quarter': the value must be a number"):
        parse_vae_tiling("tile_overlap_factor=a quarter")
    with pytest.raises(ValueError, match=r"tile_latent_min_height='2.5': the value must be a whole number"):
        parse_vae_tiling("tile_latent_min_height=2.5")
