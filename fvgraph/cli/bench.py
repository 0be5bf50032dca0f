"""`fvgraph bench NAME`: run one of the perf/ benchmarks (each prints JSON)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Optional

import typer


BENCHMARKS = {
    "step": "bench_step", "serving": "bench_serving", "scheduler": "bench_scheduler_overhead",
    "projection-cache": "bench_projection_cache", "coldstart": "bench_coldstart", "kernels": "bench_kernels",
    "http": "bench_http", "interceptors": "bench_interceptors", "lora": "bench_lora", "distilled": "bench_distilled",
    "rollouts": "bench_rollouts", "profile-step": "profile_step",
}  # fmt: skip


def bench(ctx: typer.Context, name: str = typer.Argument(..., help=f"One of: {', '.join(BENCHMARKS)}."),
          plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw the JSON it prints (PNG; fvgraph/plots.py).")) -> None:
    """Run one of the perf/ benchmarks; it prints JSON. Everything after NAME is its own options
    (`fvgraph bench step --gpu`; its own help: `fvgraph bench kernels -- --help`). `--plot out.png`
    draws each JSON line it printed: every timing's median with its min-max range (and for step
    caching, speedup against quality, beside it as out-tradeoff.png)."""
    import importlib

    if name not in BENCHMARKS:
        raise typer.BadParameter(f"{name!r} is not a benchmark; choose one of {', '.join(BENCHMARKS)}", param_hint="NAME")
    main = importlib.import_module(f"fvgraph.perf.{BENCHMARKS[name]}").main
    if plot is None:
        main(ctx.args)
        return
    printed = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
        main(ctx.args)
    from fvgraph.plots import plot_bench_line, plot_caching_tradeoff, spreads

    lines = [json.loads(text) for text in printed.getvalue().splitlines() if text.startswith("{")]
    lines = [line for line in lines if isinstance(line, dict) and any(spreads(line))]
    if not lines:
        raise typer.BadParameter(f"benchmark {name!r} printed no JSON line with timings to plot", param_hint="--plot")
    for i, line in enumerate(lines):
        path = plot if len(lines) == 1 else plot.with_name(f"{plot.stem}-{i + 1}{plot.suffix}")
        typer.echo(f"wrote {plot_bench_line(line, path)}", err=True)
        if isinstance(line.get("methods"), dict):
            typer.echo(f"wrote {plot_caching_tradeoff(line, path.with_name(f'{path.stem}-tradeoff{path.suffix}'))}", err=True)


class _Tee(io.TextIOBase):
    """Writes to both streams: the benchmark's JSON still reaches stdout while it is kept for the plot."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
