"""`fvgraph parity`: diff two settings tap by tap, or a cached run against the uncached one."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fvgraph.cli.caching import cache_quality
from fvgraph.cli.model_choice import CARD_OPTION, CHECKPOINT_OPTION, choose_model
from fvgraph.cli.options import (LORA_OPTION, LORA_TARGET_MODULES_OPTION, MAX_LORA_RANK_OPTION, MAX_LORAS_OPTION, adapter_options, console,
                                 cuda_graphs_note, opt_level_option, parse_level, writable_dir)  # fmt: skip

PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # what --plot writes (matplotlib picks the format by suffix)


def parity(
    card: Optional[str] = CARD_OPTION,
    checkpoint: Optional[str] = CHECKPOINT_OPTION,
    opt_level: int = opt_level_option("The setting under test (0-3)."),
    against: str = typer.Option("0", help="The reference opt level; 'none' (with --cache): the same level uncached."),
    compile_backend: str = typer.Option("inductor"),
    disable_pass: list[str] = typer.Option([], "--disable-pass"),
    prompt: list[str] = typer.Option(["a red fox running through fresh snow", "waves at dusk"], "--prompt", "-p"),
    num_inference_steps: Optional[int] = typer.Option(None, "--steps", help="Default 4, or a distilled recipe's own count."),
    num_frames: Optional[int] = typer.Option(None, "--frames", help="Default 5, or 1 on an image card."),
    device: Optional[str] = typer.Option(None),
    report: Optional[Path] = typer.Option(None, help="Write the JSON-lines report here."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Step caching on both sides (METHOD[:k=v,...]); with "
                                        "--against none, the distance of the cached run from the uncached one."),
    lora: list[str] = LORA_OPTION,
    max_loras: Optional[int] = MAX_LORAS_OPTION,
    max_lora_rank: Optional[int] = MAX_LORA_RANK_OPTION,
    lora_target_modules: Optional[str] = LORA_TARGET_MODULES_OPTION,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the tap x step error heatmap (PNG) here."),
) -> None:
    """Diff two settings tap by tap (every block, both CFG branches, predictions, latents) per step.
    Exits 1 when a tap exceeds the card's tolerance, naming the first divergence. With `--cache ...
    --against none`: report how far the cached run lands from the uncached one (relative L2 of the
    latents per step, PSNR of the frames); reported, not asserted. `--plot FILE.png` draws the error
    per tap and step with the tolerance and the first divergence marked. With `--lora`, both sides load the
    adapters and every request runs them at scale 1."""
    from fvgraph.parity import Setting, compare
    from fvgraph.request import Request

    try:
        from fvgraph.runtime.opt_levels import opt_level as level_config

        if against == "none" and cache is None:
            raise ValueError("--against none compares a cached run with the uncached one: give --cache METHOD[:k=v,...]")
        reference = None if against == "none" else parse_level(against, "--against")
        for level in (opt_level, reference if reference is not None else opt_level):
            level_config(level)
        adapters = adapter_options(lora, [], max_loras, max_lora_rank, lora_target_modules)
        choice = choose_model(None, card, checkpoint)
        card, checkpoint = choice.card, choice.folder
        recipe = card.recipe  # a distilled recipe fixes its steps and takes no guidance
        num_frames = num_frames or min(5, card.shapes.max_frames)
        steps = num_inference_steps or (recipe.default_steps if recipe.step_distilled else 4)
        requests = [
            Request(prompt=text, seed=i, guidance_scale=None if recipe.cfg_distilled else 5.0 - i, num_inference_steps=steps,
                    num_frames=num_frames,
                    cache=cache, loras=dict.fromkeys(adapters["loras"], 1.0) if adapters["loras"] else None)  # fmt: skip
            for i, text in enumerate(prompt)
        ]
        if report is not None:
            writable_dir(report.parent, "--report")  # the report is written after the whole comparison
        if plot is not None:  # so is the plot: a bad path must not cost the run, nor read as a divergence
            if plot.suffix.lower() not in PLOT_SUFFIXES:
                raise ValueError(f"--plot {plot}: the file's suffix names its format, one of {', '.join(PLOT_SUFFIXES)}")
            writable_dir(plot.parent, "--plot")
        for note in dict.fromkeys(cuda_graphs_note(level, device) for level in (opt_level, reference or 0)):
            if note is not None:  # said once, however many sides run at a CUDA-graph level
                console.print(note, style="yellow", highlight=False, soft_wrap=True)
        if reference is None:
            cache_quality(card, checkpoint, opt_level, compile_backend, disable_pass, device, requests, cache, report)
            return
        b = Setting(opt_level, compile_backend, tuple(disable_pass))
        result = compare(card, requests, Setting(reference, compile_backend), b, checkpoint=checkpoint, device=device,
                         adapters=adapters)  # fmt: skip
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
    if plot is not None:
        from fvgraph.plots import plot_parity

        console.print(f"wrote {plot_parity(result, plot)}")
    summary = result.summary()
    if not summary["passed"]:
        console.print(f"[red]failed[/red]: {summary['failed']} of {summary['comparisons']}; first divergence {summary['first_divergence']}")
        raise typer.Exit(1)
    console.print(f"passed: {summary['comparisons']} comparisons within atol={result.config['atol']} rtol={result.config['rtol']}")
