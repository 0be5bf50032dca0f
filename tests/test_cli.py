"""The command line: generate writes a video a person can open; env reports versions and packages."""

import json

from PIL import Image
from typer.testing import CliRunner

from fvgraph.cli import app

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
    result = runner.invoke(app, ["generate", "-p", "a", "-p", "b", "--steps", "1", "--frames", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v_0.gif").is_file() and (tmp_path / "v_1.gif").is_file()


def test_generate_reports_bad_input_and_exits_nonzero(tmp_path):
    result = runner.invoke(app, ["generate", "--frames", "6", "-o", str(tmp_path / "x.gif")])
    assert result.exit_code == 2
    assert "num_frames=6 must be 4k+1" in result.output


def test_env_reports_versions_and_optional_kernels():
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["torch"] and report["diffusers"]
    assert set(report["optional_kernels"]) == {"triton", "flashinfer", "cutlass", "nsight"}
    assert "tiny-wan" in report["cards"]
