"""The command line: generate writes a video a person can open; env reports versions and packages;
bench runs a perf/ benchmark by name."""

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
