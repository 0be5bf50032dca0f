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


def test_bench_plots_read_in_words_from_zero_with_the_ratio_line_and_log_axes_for_decades():
    from fvgraph.plots import bench_line_figure

    spread = lambda lo, mid, hi: {"repeats": 3, "min": lo, "median": mid, "max": hi}  # noqa: E731
    line = {"bench": "distilled", "card": "wan-cpu-bench", "commit": "abc",
            "s_per_request": {"base_50step_cfg": spread(9.9, 10.3, 14.0), "distilled_4step": spread(0.4, 0.5, 0.6)},
            "time_ratio_per_round": {"base_vs_distilled": spread(19.9, 26.7, 27.0)},
            "gflops_per_s": {"gemm_384x512x512": spread(180.0, 190.0, 195.0)},
            "samples_per_s": {"engine": spread(0.01, 0.02, 0.03), "loop": spread(5.0, 6.0, 7.0)}}  # fmt: skip
    fig = bench_line_figure(line)
    by_label = {ax.get_xlabel(): ax for ax in fig.axes}
    assert set(by_label) == {"seconds (median, bar: min-max)", "ratio, x (dashed: 1.0) (median, bar: min-max)",
                             "GFLOP/s (median, bar: min-max)", "samples/s (median, bar: min-max), log scale"}  # fmt: skip
    seconds = by_label["seconds (median, bar: min-max)"]
    assert seconds.get_xlim()[0] == 0  # the 20x between the two shows on one axis from zero
    assert [t.get_text() for t in seconds.get_yticklabels()] == ["per request / base 50step cfg", "per request / distilled 4step"]
    ratio = by_label["ratio, x (dashed: 1.0) (median, bar: min-max)"]
    assert ratio.get_xlim()[0] == 0 and any(list(l.get_xdata()) == [1.0, 1.0] for l in ratio.get_lines())
    assert by_label["samples/s (median, bar: min-max), log scale"].get_xscale() == "log"
    labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    assert all("_" not in label for label in labels), labels


def test_the_parity_heatmap_labels_its_axes(monkeypatch, tmp_path):
    import fvgraph.plots as plots
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, plt, path: figures.append(fig) or Path(path))
    report = compare("tiny-wan", [Request(prompt="a fox", seed=0, num_inference_steps=1, num_frames=1, height=32, width=32)],
                     Setting(0), Setting(0, batched=True))  # fmt: skip
    plot_parity(report, tmp_path / "p.png")
    ax = figures[0].axes[0]
    assert ax.get_xlabel() == "request r, denoise step s" and ax.get_ylabel() == "tap (execution order)"
    assert figures[0].axes[1].get_ylabel().startswith("max |a - b|, log scale")


def test_plot_results_reports_what_it_skipped(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("plot_results", RESULTS.parent / "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    spread = {"repeats": 2, "min": 1.0, "median": 1.5, "max": 2.0}
    results = tmp_path / "r.jsonl"
    results.write_text("\n".join(json.dumps(line) for line in (
        {"bench": "step", "per_step_ms": {"a": spread}}, {"bench": "profile_step", "ops": {"addmm": 0.7}},
        {"bench": "lora", "per_step_ms": {"a": spread}})) + "\n")  # fmt: skip
    assert len(module.main([str(results), "--out", str(tmp_path / "out")])) == 2
    assert capsys.readouterr().err.strip() == f"{results}: plotted 2 of 3 lines, skipped 1 (1 without spreads: lines 2 (profile_step))"
    assert len(module.main([str(results), "--out", str(tmp_path / "out"), "--bench", "step"])) == 1
    assert capsys.readouterr().err.strip() == (f"{results}: plotted 1 of 3 lines, skipped 2 (2 of another bench: lines 2 "
                                               "(profile_step), 3 (lora))")  # fmt: skip
