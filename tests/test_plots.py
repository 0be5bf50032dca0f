"""The plots the commands draw: a parity report's heatmap (with a divergence marked), a results
file's lines with their spreads, step caching's trade-off; and every recorded results line is JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import PIL.Image
import pytest

from fvgraph.parity import Setting, compare
from fvgraph.plots import plot_bench_line, plot_caching_tradeoff, plot_parity, spreads
from fvgraph.request import Request

RESULTS = Path(__file__).resolve().parents[1] / "perf" / "results"


def _png(path: Path) -> tuple[int, int]:
    with PIL.Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_parity_heatmap_marks_the_first_divergence(tmp_path):
    def break_a_block(engine):  # side b's second block adds a bias: every later tap diverges
        block = engine.loop.components.transformer.blocks[1]
        block.ffn.net[2].bias.data += 1e-2

    requests = [Request(prompt="a fox", seed=0, num_inference_steps=2, num_frames=1, height=32, width=32)]
    report = compare("tiny-wan", requests, Setting(0), Setting(0, batched=True), prepare_b=break_a_block)
    assert not report.passed and report.first_divergence.tap.startswith("tap.block.1")
    width, height = _png(plot_parity(report, tmp_path / "parity.png"))
    assert width > 300 and height > 200


def test_results_files_are_json_lines_and_plot(tmp_path):
    files = sorted(RESULTS.glob("*.jsonl"))
    assert files
    for path in files:
        for number, text in enumerate(path.read_text().splitlines(), start=1):
            assert isinstance(json.loads(text), dict), f"{path.name}:{number}"
    spec = importlib.util.spec_from_file_location("plot_results", RESULTS.parent / "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.main([str(files[-1]), "--out", str(tmp_path)])
    assert written and all(_png(path) for path in written)


def test_bench_line_and_caching_tradeoff_plots(tmp_path):
    spread = {"repeats": 3, "min": 1.0, "median": 2.0, "max": 4.0}
    line = {"bench": "interceptors", "card": "wan-cpu-bench", "steps": 10,
            "uncached_wall_ms": {"fvgraph_none": spread},
            "methods": {"magcache": {"fvgraph": {"wall_ms": spread, "speedup": {**spread, "median": 2.3}},
                                     "quality": {"final_rel_l2": 0.01}}}}  # fmt: skip
    assert [name for name, _ in spreads(line)] == ["uncached_wall_ms.fvgraph_none", "methods.magcache.fvgraph.wall_ms",
                                                   "methods.magcache.fvgraph.speedup"]  # fmt: skip
    assert _png(plot_bench_line(line, tmp_path / "line.png")) and _png(plot_caching_tradeoff(line, tmp_path / "trade.png"))
    with pytest.raises(ValueError, match="no min / median / max"):
        plot_bench_line({"bench": "x"}, tmp_path / "none.png")


def test_bench_plot_draws_what_the_benchmark_printed(tmp_path):
    from typer.testing import CliRunner

    from fvgraph.cli import app

    out = tmp_path / "distilled.png"
    result = CliRunner().invoke(app, ["bench", "distilled", "--plot", str(out), "--card", "tiny-wan", "--shape", "48x64x5",
                                      "--base-steps", "2", "--repeats", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    line = json.loads(next(text for text in result.stdout.splitlines() if text.startswith("{")))
    assert line["bench"] == "distilled" and _png(out)
