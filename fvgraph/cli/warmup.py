"""`fvgraph warmup`: compile every shape and batch bucket into the capture cache, offline."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import typer

from fvgraph.cli.progress import RunProgress
from fvgraph.cli.model_choice import CARD_OPTION, CHECKPOINT_OPTION, choose_model
from fvgraph.cli.options import (ARTIFACT_FORMAT_OPTION, DEFAULT_CACHE_DIR, LORA_OPTION, LORA_TARGET_MODULES_OPTION, MAX_LORA_RANK_OPTION, MAX_LORAS_OPTION, MERGE_LORA_OPTION,
                                 adapter_options, card_with_cache, compile_config, console, cuda_graphs_note, opt_level_option,
                                 parse_shape, writable_dir)  # fmt: skip


def warmup(
    card: Optional[str] = CARD_OPTION,
    checkpoint: Optional[str] = CHECKPOINT_OPTION,
    cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache."),
    opt_level: int = opt_level_option("1 compiled steps; 2 + CUDA graphs (GPU; captured at every start); 3 + FP8 kernels."),
    buckets: str = typer.Option("1,2,4,8", help="Batch buckets, comma separated."),
    shape: list[str] = typer.Option([], "--shape", help="FRAMESxHEIGHTxWIDTH (repeatable). Default: the card's default shape."),
    guidance: list[float] = typer.Option([], "--guidance", help="Repeatable: >1 warms the CFG step, 1 the plain one. Default: the card's."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    artifact_format: str = ARTIFACT_FORMAT_OPTION,
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
    num_inference_steps: Optional[int] = typer.Option(None, "--steps", help="Steps of each warmup request (default: the "
                                                      "card's fewest; with --cache, as many as served requests run, so "
                                                      "the schedule reaches its reuse steps)."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Warm with step caching (METHOD[:k=v,...]): its keep and reuse "
                                        "kinds are compiled at every bucket too; serve with the same --cache."),
    lora: list[str] = LORA_OPTION,
    merge_lora: list[str] = MERGE_LORA_OPTION,
    max_loras: Optional[int] = MAX_LORAS_OPTION,
    max_lora_rank: Optional[int] = MAX_LORA_RANK_OPTION,
    lora_target_modules: Optional[str] = LORA_TARGET_MODULES_OPTION,
) -> None:
    """Compile the compiled step kinds of every shape and batch bucket into the capture cache, so later
    processes (`generate --cache-dir`, `Engine.from_card(cache_dir=...)`) start without compiling.
    Adapter slots (--lora, --max-loras) change every denoise step's signature, merged adapters the
    weights version: warm with the flags the server runs with."""
    from fvgraph.runtime.buckets import BucketSpec
    from fvgraph.request import Request
    from fvgraph.engine.engine import Engine
    from fvgraph.runtime.opt_levels import compiling_levels

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    began = time.perf_counter()
    try:

        if opt_level not in compiling_levels():
            *others, last = (f"-O{n}" for n in compiling_levels())
            raise ValueError(f"-O{opt_level}: warmup compiles, so it takes {', '.join(others)} or {last}")
        writable_dir(cache_dir, "--cache-dir")  # a warmup that can store nothing is no warmup
        choice = choose_model(None, card, checkpoint)
        model = card_with_cache(choice.card, cache)  # warmup requests take the card's (or --cache's) step caching
        rules = model.shapes
        shapes = [parse_shape(text) for text in shape] or [(rules.default_frames, rules.default_height, rules.default_width)]
        spec = BucketSpec(batch_sizes=tuple(int(b) for b in buckets.split(",")), shapes=tuple(shapes))
        scales, steps = guidance or [model.recipe.default_guidance_scale], num_inference_steps or model.recipe.allowed_steps[0]
        for f, h, w in shapes:  # the card's limits, before loading anything
            for g in scales:
                Request(prompt="warmup", num_frames=f, height=h, width=w, guidance_scale=g, num_inference_steps=steps).resolve(model)
        engine = Engine.from_card(
            model, checkpoint=choice.folder, opt_level=opt_level, device=device, cache_dir=cache_dir, buckets=spec,
            compile_config=compile_config(compile_backend, disable_pass, artifact_format=artifact_format),
            **adapter_options(lora, merge_lora, max_loras, max_lora_rank, lora_target_modules),
        )  # fmt: skip
        requests = [engine.loop.warmup_request(f, h, w, g, steps) for f, h, w in shapes for g in scales]
    except Exception as err:  # bad card, shape or bucket list: say why and stop
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if (note := cuda_graphs_note(opt_level, device)) is not None:
        console.print(note, style="yellow", highlight=False, soft_wrap=True)
    # Each bucket's compile is announced as it starts, with its elapsed time (fvgraph/cli/progress.py).
    with RunProgress(console, "buckets", len(requests) * len(spec.batch_sizes), transient=False) as progress:
        results = engine.warmup(requests, on_bucket=lambda batch: progress.advance())
    c = engine.counters
    console.print(
        f"warm: {len(engine.compiler.signatures)} step graphs ({c.compiles} compiled, {c.capture_cache_hits} loaded, "
        f"{c.capture_cache_rejects} rejected and rebuilt) in {time.perf_counter() - began:.1f} s -> {engine.compiler.capture_cache.dir}"
    )
    failed = [r for r in results if not r.ok]
    for result in failed:
        console.print(f"[red]{result.request_id} {result.status}:[/red] {result.error}")
    unstored = [s for s in engine.compiler.signatures if engine.compiler.capture_cache.find(s.key()) is None]
    for signature in unstored:
        console.print(f"[red]not stored in the capture cache:[/red] {signature.step_kind} batch {signature.batch} "
                      f"({signature.key()}); see the warnings above")  # fmt: skip
    if failed or unstored:
        raise typer.Exit(1)
