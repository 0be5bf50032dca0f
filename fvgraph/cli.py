"""The `fvgraph` command line: generate videos and report the environment."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="fvgraph: a compiled runtime for diffusion transformers")
console = Console()


@app.command()
def generate(
    prompt: list[str] = typer.Option(["a red fox running through fresh snow"], "--prompt", "-p", help="Repeat for several interleaved requests."),
    negative_prompt: Optional[str] = typer.Option(None, help="Defaults to '' when guidance is on."),
    card: str = typer.Option("tiny-wan", help="Card name (see `fvgraph env`)."),
    checkpoint: Optional[Path] = typer.Option(None, help="Local diffusers folder with the card's weights."),
    num_inference_steps: Optional[int] = typer.Option(None, "--steps", help="Default: the card's recipe."),
    guidance_scale: Optional[float] = typer.Option(None, "--guidance", help="Default: the card's recipe."),
    height: Optional[int] = typer.Option(None),
    width: Optional[int] = typer.Option(None),
    num_frames: Optional[int] = typer.Option(None, "--frames"),
    seed: int = typer.Option(0, help="Request i uses seed + i."),
    opt_level: int = typer.Option(0, "-O", "--opt-level", help="0 eager, 1 compiled + batched steps, 2 + CUDA graphs."),
    no_cudagraph: bool = typer.Option(False, "--no-cudagraph", help="At -O2, keep everything but the CUDA graphs."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Run eagerly whatever the opt level."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor (at -O1 and up)."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    compile_steps: str = typer.Option("denoise", help="Step kinds to compile: 'denoise' or 'all'."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
    output: Path = typer.Option(Path("outputs/video.gif"), "--output", "-o", help=".gif or .mp4; several prompts add _i."),
    fps: int = typer.Option(8),
) -> None:
    """Generate one video per prompt, interleaving the requests step by step, and print a timing table."""
    from fvgraph.compiler import CompileConfig
    from fvgraph.engine import Engine
    from fvgraph.passes.manager import PassConfig
    from fvgraph.request import Request
    from fvgraph.video_io import write_video

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    began = time.perf_counter()
    try:
        if compile_backend not in ("eager", "aot_eager", "inductor"):
            raise ValueError(f"--compile-backend={compile_backend!r} must be eager, aot_eager or inductor")
        if compile_steps not in ("denoise", "all"):
            raise ValueError(f"--compile-steps={compile_steps!r} must be 'denoise' or 'all'")
        config = CompileConfig(
            backend=compile_backend,
            passes=PassConfig(disabled=tuple(disable_pass)),
            step_kinds=None if compile_steps == "all" else CompileConfig().step_kinds,
        )
        engine = Engine.from_card(
            card, checkpoint=checkpoint, opt_level=opt_level, device=device, compile_config=config,
            enforce_eager=enforce_eager, cuda_graphs=not no_cudagraph,
        )  # fmt: skip
        requests = [
            Request(
                prompt=text, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale, height=height, width=width, num_frames=num_frames, seed=seed + i,
            )
            for i, text in enumerate(prompt)
        ]  # fmt: skip
    except Exception as err:  # bad card, checkpoint or request: say why and stop
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    load_s = time.perf_counter() - began

    total_steps = sum((r.num_inference_steps or engine.card.recipe.default_steps) for r in requests)
    columns = (TextColumn("denoise"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("denoise", total=total_steps)
        results = engine.generate(requests, on_step=lambda state, kind: bar.advance(task) if "denoise" in kind else None)

    title = f"{engine.card.card_id} -O{engine.opt_level} on {engine.loop.components.device} (load {load_s:.2f} s)"
    table = Table(title=title)
    for column in ("request", "status", "compile", "encode", "denoise", "per step", "decode", "total"):
        table.add_column(column, justify="left" if column in ("request", "status") else "right")
    written = []
    failed = False
    for i, (request, result) in enumerate(zip(requests, results)):
        path = output if len(requests) == 1 else output.with_name(f"{output.stem}_{i}{output.suffix}")
        if result.ok and result.frames is not None:
            written.append(write_video(result.frames, path, fps=fps))
        failed |= not result.ok
        t = result.timings
        steps = request.num_inference_steps or engine.card.recipe.default_steps
        fmt = lambda key: f"{t[key]:.3f}" if key in t else "-"  # noqa: E731
        per_step = f"{t['denoise'] / steps:.4f}" if "denoise" in t else "-"
        table.add_row(
            result.request_id, result.status, fmt("compile"), fmt("text_encode"), fmt("denoise"), per_step,
            fmt("vae_decode"), fmt("total"),
        )  # fmt: skip
        if not result.ok:
            console.print(f"[red]{result.request_id} {result.status}:[/red] {result.error}")
    table.caption = f"seconds; 'total' is wall time from submit to result; compiles: {engine.counters.compiles}"
    console.print(table)
    for path in written:
        console.print(f"wrote {path}")
    if failed:
        raise typer.Exit(1)


@app.command()
def parity(
    card: str = typer.Option("tiny-wan"),
    checkpoint: Optional[Path] = typer.Option(None, help="Local diffusers folder with the card's weights."),
    opt_level: int = typer.Option(1, "-O", "--opt-level", help="The setting under test."),
    against: int = typer.Option(0, help="The reference opt level."),
    compile_backend: str = typer.Option("inductor"),
    disable_pass: list[str] = typer.Option([], "--disable-pass"),
    prompt: list[str] = typer.Option(["a red fox running through fresh snow", "waves at dusk"], "--prompt", "-p"),
    num_inference_steps: int = typer.Option(4, "--steps"),
    num_frames: int = typer.Option(5, "--frames"),
    device: Optional[str] = typer.Option(None),
    report: Optional[Path] = typer.Option(None, help="Write the JSON-lines report here."),
) -> None:
    """Diff two settings tap by tap (every block, both CFG branches, predictions, latents) per step.
    Exits 1 when a tap exceeds the card's tolerance, naming the first divergence."""
    from fvgraph.parity import Setting, compare
    from fvgraph.request import Request

    try:
        for level in (opt_level, against):
            if level not in (0, 1, 2):
                raise ValueError(f"opt_level={level} is not available; use 0, 1 or 2")
        requests = [
            Request(prompt=text, seed=i, guidance_scale=5.0 - i, num_inference_steps=num_inference_steps, num_frames=num_frames)
            for i, text in enumerate(prompt)
        ]
        b = Setting(opt_level, compile_backend, tuple(disable_pass))
        result = compare(card, requests, Setting(against, compile_backend), b, checkpoint=checkpoint, device=device)
    except Exception as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    table = Table(title=f"parity {result.config['a']} vs {result.config['b']} on {result.config['card']}")
    for column in ("step", "tap", "max_abs", "rel_diff", "noise floor", "ok"):
        table.add_column(column)
    worst = sorted(result.comparisons, key=lambda c: -c.max_abs)[:8]
    for c in sorted(worst, key=lambda c: (c.request, c.step)):
        table.add_row(f"r{c.request} s{c.step}", c.tap, f"{c.max_abs:.3g}", f"{c.rel_diff:.3g}", f"{c.floor_max_abs:.3g}", "yes" if c.passed else "NO")
    console.print(table)
    if report is not None:
        result.write_jsonl(report)
        console.print(f"wrote {report}")
    summary = result.summary()
    if not summary["passed"]:
        console.print(f"[red]failed[/red]: {summary['failed']} of {summary['comparisons']}; first divergence {summary['first_divergence']}")
        raise typer.Exit(1)
    console.print(f"passed: {summary['comparisons']} comparisons within atol={result.config['atol']} rtol={result.config['rtol']}")


@app.command()
def env(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Versions of torch / CUDA / triton / diffusers, the GPU, optional kernel packages, and the cards."""
    from fvgraph.cards import card_names
    from fvgraph.env_report import environment

    report = environment()
    report["cards"] = card_names()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(title="fvgraph environment", show_header=False)
    for key, value in report.items():
        if key == "optional_kernels":
            for name, info in value.items():
                state = f"importable ({info['version']})" if info["importable"] else "not installed"
                table.add_row(f"kernel package {name}", state)
        else:
            table.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
    console.print(table)


if __name__ == "__main__":
    app()
