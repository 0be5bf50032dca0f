"""The command line: generate writes a video a person can open, from an image or a video as the Python
API does; env reports versions and packages; bench runs a perf/ benchmark by name."""

import json

import av
import numpy as np
from PIL import Image
from typer.testing import CliRunner

from fvgraph.cli import app
from fvgraph.media_file import write_video

runner = CliRunner()


def test_generate_writes_a_gif_and_a_timing_table(tmp_path):
    out = tmp_path / "fox.gif"
    result = runner.invoke(app, ["generate", "-p", "a fox", "--steps", "2", "--frames", "5", "-O0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "denoise" in result.output and "per step" in result.output
    with Image.open(out) as gif:
        assert gif.n_frames == 5 and gif.size == (64, 64)


def test_several_prompts_write_one_file_each(tmp_path):
    out = tmp_path / "v.gif"
    result = runner.invoke(app, ["generate", "-p", "a", "-p", "b", "--steps", "1", "--frames", "1", "-O0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v_0.gif").is_file() and (tmp_path / "v_1.gif").is_file()


def test_generate_reports_bad_input_and_exits_nonzero(tmp_path):
    result = runner.invoke(app, ["generate", "--frames", "6", "-o", str(tmp_path / "x.gif")])
    assert result.exit_code == 2
    assert "--frames=6 must be 4k+1" in result.output


def test_env_reports_versions_and_optional_kernels():
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["torch"] and report["diffusers"]
    assert set(report["optional_kernels"]) == {"triton", "nsight"}
    assert "tiny-wan" in report["cards"]


def test_bench_runs_a_perf_benchmark_and_passes_its_options_through():
    result = runner.invoke(app, ["bench", "kernels", "--cpu"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    timed = [line for line in lines if "ms" in line]  # one line says why Nsight metrics were skipped
    assert {"linear", "norm_modulate_quant", "attention"} <= {t["kernel"].split(".")[0] for t in timed}
    assert all(t["machine"]["gpu"] is None and t["method_version"] >= 1 and t["ms"]["min"] > 0 for t in timed)


def test_bench_names_the_benchmarks_when_given_an_unknown_one():
    result = runner.invoke(app, ["bench", "nope"])
    assert result.exit_code == 2
    assert "'nope' is not a benchmark" in result.output and "scheduler" in result.output


def _generated(tmp_path, name: str, *args: str) -> bytes:
    out = tmp_path / f"{name}.gif"
    result = runner.invoke(app, ["generate", *args, "-p", "a fox", "--steps", "2", "--frames", "5", "-O0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out.read_bytes()


def _expected(tmp_path, card: str, **fields) -> bytes:
    """The Python API's result for the same request, written as generate writes it."""
    from fvgraph.engine.engine import Engine
    from fvgraph.media_file import write_video
    from fvgraph.request import Request

    [result] = Engine.from_card(card, device="cpu").generate([Request(prompt="a fox", num_inference_steps=2, num_frames=5, seed=0, **fields)])
    assert result.ok, result.error
    return write_video(result.frames, tmp_path / "expected.gif", fps=8).read_bytes()


def test_generate_starts_from_an_image_as_the_python_api_does(tmp_path):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    image.save(tmp_path / "first.png")
    made = _generated(tmp_path, "i2v", "tiny-wan-i2v", "--image", str(tmp_path / "first.png"))
    assert made == _expected(tmp_path, "tiny-wan-i2v", image=image)


def test_generate_starts_from_a_video_as_the_python_api_does(tmp_path):
    """The video's frames as PyAV decodes them, at --strength."""
    frames = np.random.default_rng(1).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    clip = write_video(frames, tmp_path / "clip.mp4", fps=8)
    with av.open(str(clip)) as container:
        decoded = [frame.to_image() for frame in container.decode(video=0)]
    made = _generated(tmp_path, "v2v", "tiny-wan", "--video", str(clip), "--strength", "0.6")
    assert made == _expected(tmp_path, "tiny-wan", video=decoded, strength=0.6)
