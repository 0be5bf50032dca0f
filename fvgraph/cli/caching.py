"""The command line's step-caching parts (docs/step_caching.md): `--cache`'s help and report line,
`fvgraph calibrate`, and the quality rung `fvgraph parity --cache ... --against none`. (`--cache`
becomes the card's default in fvgraph/cli/options.py.)"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fvgraph.cli.options import compile_config, console, writable_dir

CACHE_HELP = ("Step caching for requests that give none (docs/step_caching.md): METHOD[:k=v,...], e.g. "
              "magcache:threshold=0.06; 'none' turns the card's default off.")  # fmt: skip


def cache_line(cache: dict) -> str:
    """What a request's step caching did, in words (Result.cache)."""
    return f"{cache['method']}: {cache['computed']} denoiser calls computed, {cache['reused']} reused"


def calibrate(
    card: str = typer.Option("tiny-wan", help="Card name (see `fvgraph env`)."),
    checkpoint: Optional[str] = typer.Option(None, help="The card's weights: a Hub repo id or a local diffusers folder."),
    num_inference_steps: int = typer.Option(..., "--steps", help="Steps of the calibration run (ratios are interpolated to other counts)."),
    method: str = typer.Option("magcache", help="The cache method whose settings are calibrated."),
    prompt: str = typer.Option("a red fox running through fresh snow", "--prompt", "-p"),
    guidance_scale: Optional[float] = typer.Option(None, "--guidance", help="Default: the card's recipe."),
    height: Optional[int] = typer.Option(None),
    width: Optional[int] = typer.Option(None),
    num_frames: Optional[int] = typer.Option(None, "--frames"),
    seed: int = typer.Option(0),
    opt_level: int = typer.Option(0, "-O", "--opt-level", help="0 eager (the reference), 1 and up compiled."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor (at -O1 and up)."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
    cache_dir: Path = typer.Option(Path("capture_cache"), help="Root of the capture cache; the settings go to its calibration/ folder."),
) -> None:
    """Measure a step-caching method's calibrated settings (MagCache: mag_ratios) on the loaded weights and
    store them where engines of this card and weights find them, so `--cache magcache` needs none."""
    from fvgraph.caching.calibration_store import CalibrationStore, calibration_root
    from fvgraph.engine.calibrate import calibrate as run_calibration
    from fvgraph.engine.engine import Engine

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        store = CalibrationStore(calibration_root(None, cache_dir))
        writable_dir(store.root, "--cache-dir")
        engine = Engine.from_card(card, checkpoint=checkpoint, opt_level=opt_level, device=device,
                                  compile_config=compile_config(compile_backend, []))  # fmt: skip
        shape = {k: v for k, v in {"guidance_scale": guidance_scale, "height": height, "width": width,
                                   "num_frames": num_frames}.items() if v is not None}  # fmt: skip
        record, path = run_calibration(engine, method, num_inference_steps, seed=seed, store=store, prompt=prompt, **shape)
    except Exception as err:  # bad card, checkpoint, method or shape: say why and stop
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    for name, value in record["values"].items():
        shown = ", ".join(f"{v:.4f}" for v in value) if isinstance(value, list) else str(value)
        console.print(f"{name}: [{shown}]", highlight=False)
    console.print(f"wrote {path} ({record['seconds']:.1f} s)")


def cache_quality(card, checkpoint, opt_level, compile_backend, disable_pass, device, requests, cache, report) -> None:
    """`parity --cache ... --against none`: the cached run's distance from the uncached one, printed and written."""
    from fvgraph.step_caching_quality import cache_distance
    from fvgraph.engine.engine import Engine

    engine = Engine.from_card(card, checkpoint=checkpoint, opt_level=opt_level, device=device,
                              compile_config=compile_config(compile_backend, disable_pass))  # fmt: skip
    result = cache_distance(engine, requests, cache)
    table = Table(title=f"{engine.card.card_id} -O{engine.opt_level}: cache {cache} against none (reported, not asserted)")
    for column in ("request", "computed", "reused", "FLOPs ratio", "rel L2 per step", "final rel L2", "PSNR dB"):
        table.add_column(column)
    for r in result.requests:
        steps = " ".join(f"{d:.2g}" for d in r.rel_l2)
        table.add_row(f"r{r.request}", str(r.computed), str(r.reused), f"{r.flops_ratio:.3f}", steps, f"{r.final_rel_l2:.3g}",
                      "equal" if r.psnr is None else f"{r.psnr:.2f}")  # fmt: skip
    console.print(table)
    if report is not None:
        result.write_jsonl(report)
        console.print(f"wrote {report}")
