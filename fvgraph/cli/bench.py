"""`fvgraph bench NAME`: run one of the perf/ benchmarks (each prints JSON)."""

from __future__ import annotations

import typer


BENCHMARKS = {
    "step": "bench_step", "serving": "bench_serving", "scheduler": "bench_scheduler_overhead",
    "projection-cache": "bench_projection_cache", "coldstart": "bench_coldstart", "kernels": "bench_kernels",
    "http": "bench_http", "interceptors": "bench_interceptors", "lora": "bench_lora", "distilled": "bench_distilled",
    "rollouts": "bench_rollouts",
}  # fmt: skip


def bench(ctx: typer.Context, name: str = typer.Argument(..., help=f"One of: {', '.join(BENCHMARKS)}.")) -> None:
    """Run one of the perf/ benchmarks; it prints JSON. Everything after NAME is its own options
    (`fvgraph bench step --gpu`; its own help: `fvgraph bench kernels -- --help`)."""
    import importlib

    if name not in BENCHMARKS:
        raise typer.BadParameter(f"{name!r} is not a benchmark; choose one of {', '.join(BENCHMARKS)}", param_hint="NAME")
    importlib.import_module(f"fvgraph.perf.{BENCHMARKS[name]}").main(ctx.args)
