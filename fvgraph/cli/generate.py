"""`fvgraph generate`: one video or image per prompt, the requests interleaved step by step, and a timing table."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fvgraph.cli.caching import CACHE_HELP, cache_line
from fvgraph.cli.flag_errors import flag_error
from fvgraph.cli.progress import RunProgress
from fvgraph.cli.model_choice import CARD_OPTION, CHECKPOINT_OPTION, MODEL_ARGUMENT, choose_model
from fvgraph.cli.options import (ARTIFACT_FORMAT_OPTION, BOUNDARY_RATIO_OPTION, CACHE_METHODS_OPTION, DTYPE_OPTION, FLOW_SHIFT_OPTION, LORA_OPTION,
                                 LORA_TARGET_MODULES_OPTION, MAX_LORA_RANK_OPTION, MAX_LORAS_OPTION, MERGE_LORA_OPTION, OFFLOAD_OPTION, VAE_TILING_OPTION, adapter_options,
                                 console, cuda_graphs_note, opt_level_option, serving_engine, writable_dir)  # fmt: skip


def generate(
    model: Optional[str] = MODEL_ARGUMENT,
    prompt: list[str] = typer.Option(["a red fox running through fresh snow"], "--prompt", "-p", help="Repeat for several interleaved requests."),
    negative_prompt: Optional[str] = typer.Option(None, help="Defaults to '' when guidance is on."),
    card: Optional[str] = CARD_OPTION,
    checkpoint: Optional[str] = CHECKPOINT_OPTION,
    num_inference_steps: Optional[int] = typer.Option(None, "--steps", help="Default: the card's recipe."),
    guidance_scale: Optional[float] = typer.Option(None, "--guidance", help="Default: the card's recipe."),
    true_cfg_scale: Optional[float] = typer.Option(None, "--true-cfg", help="FLUX / Qwen-Image cards: > 1 with --negative-prompt runs classifier-free guidance."),
    height: Optional[int] = typer.Option(None),
    width: Optional[int] = typer.Option(None),
    num_frames: Optional[int] = typer.Option(None, "--frames"),
    seed: int = typer.Option(0, help="Request i uses seed + i."),
    image: Optional[Path] = typer.Option(None, "--image", help="A PNG, JPEG or WebP every request starts from: image-to-video and image-edit cards."),
    video: Optional[Path] = typer.Option(None, "--video", help="A video file whose frames every request starts from: video-to-video on a Wan text-to-video card (docs/loops.md)."),
    strength: Optional[float] = typer.Option(None, "--strength", help="With --video: how far from it, in (0, 1] (default 0.8)."),
    opt_level: int = opt_level_option(),
    no_cudagraph: bool = typer.Option(False, "--no-cudagraph", help="At -O2, keep everything but the CUDA graphs."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Run eagerly whatever the opt level."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor (at -O1 and up)."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    compile_steps: str = typer.Option("loop", help="Step kinds to compile: 'loop' (the ones the loop marks), 'all', or names."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
    cache_dir: Optional[Path] = typer.Option(None, help="Capture cache: load compiled steps from it, store new ones in it."),
    fail_on_recompile: bool = typer.Option(False, help="Compile nothing: steps missing from the cache fail."),
    artifact_format: str = ARTIFACT_FORMAT_OPTION,
    cache: Optional[str] = typer.Option(None, "--cache", help=CACHE_HELP),
    cache_methods: Optional[str] = CACHE_METHODS_OPTION,
    cfg_parallel: Optional[int] = typer.Option(None, "--cfg-parallel", help="2: cond and uncond branches on two processes (docs/parallel.md)."),
    ulysses: Optional[int] = typer.Option(None, "--ulysses", help="Ulysses degree: processes splitting each denoiser call's tokens; divides the head count."),
    dtype: Optional[str] = DTYPE_OPTION,
    flow_shift: Optional[float] = FLOW_SHIFT_OPTION,
    boundary_ratio: Optional[float] = BOUNDARY_RATIO_OPTION,
    lora: list[str] = LORA_OPTION,
    lora_scale: list[str] = typer.Option([], "--lora-scale", help="NAME=SCALE: the requests' scale of --lora NAME (default 1.0 for each)."),
    merge_lora: list[str] = MERGE_LORA_OPTION,
    max_loras: Optional[int] = MAX_LORAS_OPTION,
    max_lora_rank: Optional[int] = MAX_LORA_RANK_OPTION,
    lora_target_modules: Optional[str] = LORA_TARGET_MODULES_OPTION,
    vae_tiling: Optional[str] = VAE_TILING_OPTION,
    offload: Optional[str] = OFFLOAD_OPTION,
    output: Path = typer.Option(Path("outputs/video.gif"), "--output", "-o", help=".gif or .mp4; one frame (an image card's): .png, .jpg or .webp too. Several prompts add _i."),
    fps: int = typer.Option(8),
) -> None:
    """Generate one video (or image) per prompt, interleaving the requests step by step, and print a
    timing table. MODEL: a card name, a Hub repo id or a local diffusers folder."""
    from fvgraph.cli.input_media import read_image, read_video
    from fvgraph.parallel.executor import ParallelExecutor
    from fvgraph.request import Request
    from fvgraph.media_file import check_video_output, write_video

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    began = time.perf_counter()
    try:
        check_video_output(output, fps)  # before any work: a bad option must not cost the run
        writable_dir(output.parent, "--output")
        choice = choose_model(model, card, checkpoint)
        check_output_holds(output, choice.card, num_frames)
        adapters = adapter_options(lora, merge_lora, max_loras, max_lora_rank, lora_target_modules)
        chosen = request_loras(adapters, lora_scale)
        media = {"image": read_image(image), "video": read_video(video), "strength": strength}
        requests = [
            Request(
                prompt=text, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale, height=height, width=width, num_frames=num_frames, seed=seed + i,
                loras=chosen, **media,
            )
            for i, text in enumerate(prompt)
        ]  # fmt: skip
        engine = serving_engine(choice.card, choice.folder, opt_level, no_cudagraph, enforce_eager, compile_backend, disable_pass,
                                 device, cache_dir, fail_on_recompile, compile_steps, cache=cache,
                                 cfg_parallel=cfg_parallel, ulysses=ulysses,
                                 dtype=dtype, flow_shift=flow_shift, boundary_ratio=boundary_ratio,
                                 adapters=adapters, cache_methods=cache_methods, vae_tiling=vae_tiling, offload=offload,
                                 artifact_format=artifact_format)  # fmt: skip
        engine.loop.check_request(requests[0])  # the card's rules and calibrated settings, before any step runs
    except Exception as err:  # bad card, checkpoint or request: say why, in the flags' words, and stop
        console.print(f"[red]error:[/red] {flag_error(err)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    load_s = time.perf_counter() - began
    for note in (choice.random_weights_note(), cuda_graphs_note(opt_level, device, not no_cudagraph and not enforce_eager)):
        if note is not None:
            console.print(note, style="yellow", highlight=False, soft_wrap=True)

    kinds = engine.loop.step_kinds
    phases = list(dict.fromkeys(kind.phase for kind in kinds.values()))  # the loop's phases, in its order
    stepped = next((kind.phase for kind in kinds.values() if kind.per_inference_step), None)
    total_steps = sum((r.num_inference_steps or engine.card.recipe.default_steps) for r in requests)
    after = phases[phases.index(stepped) + 1] if stepped in phases[:-1] else None  # what runs after the last step (decode)
    with RunProgress(console, stepped or "steps", total_steps) as progress:
        ended: dict[str, int] = {}  # steps done per phase after the stepped one

        def on_step(state, kind: str) -> None:
            declared = kinds.get(kind)
            if declared is not None and declared.per_inference_step:
                progress.advance()
                if progress.done == total_steps and after is not None:
                    progress.wait(after.replace("_", " "))
            elif declared is not None and declared.phase == after:  # a decode step (one per tile when tiled)
                ended[after] = ended.get(after, 0) + 1
                progress.wait(f"{after.replace('_', ' ')} ({ended[after]} done)", announce=False)

        try:
            results = engine.generate(requests, on_step=on_step)
        finally:
            engine.close()  # a parallel engine's worker processes

    title = f"{engine.card.card_id} -O{engine.opt_level} on {engine.loop.components.device} (load {load_s:.2f} s)"
    table = Table(title=title)
    # The loop's phases in its order that some request ran (a text-to-video run encodes no video),
    # "per step" after the phase that runs once per inference step.
    ran = {phase for result in results for phase in result.timings}
    shown = [c for phase in phases if phase in ran for c in ((phase, "per step") if phase == stepped else (phase,))]
    for column in ("request", "status", "compile", *shown, "total"):
        title = column.replace("_", " ")  # narrow tables wrap at spaces rather than cut the name
        table.add_column(title, justify="left" if column in ("request", "status") else "right")
    written = []
    failed = False
    for i, (request, result) in enumerate(zip(requests, results)):
        path = output if len(requests) == 1 else output.with_name(f"{output.stem}_{i}{output.suffix}")
        if result.ok and result.frames is not None:
            try:
                written.append(write_video(result.frames, path, fps=fps))
            except (OSError, ValueError) as err:  # the disk filled up, say: the other videos are still written
                console.print(f"[red]{result.request_id}: writing {path} failed:[/red] {err}")
                failed = True
        failed |= not result.ok
        t = result.timings
        steps = request.num_inference_steps or engine.card.recipe.default_steps
        fmt = lambda key: f"{t[key]:.3f}" if key in t else "-"  # noqa: E731
        per_step = f"{t[stepped] / steps:.4f}" if stepped in t else "-"
        cells = [per_step if column == "per step" else fmt(column) for column in shown]
        table.add_row(result.request_id, result.status, fmt("compile"), *cells, fmt("total"))
        if not result.ok:
            console.print(f"[red]{result.request_id} {result.status}:[/red] {result.error}")
    for result in results:
        if result.cache is not None:
            console.print(f"{result.request_id} cache {cache_line(result.cache)}", highlight=False)
    c = engine.counters
    table.caption = f"seconds; 'total' is wall time from submit to result; compiles: {c.compiles}, cache hits: {c.capture_cache_hits}"
    console.print(table)
    if isinstance(engine.executor, ParallelExecutor):  # which ranks did the work
        console.print(engine.executor.group.summary(), highlight=False, soft_wrap=True)
    for path in written:
        console.print(f"wrote {path}")
    if failed:
        raise typer.Exit(1)


def check_output_holds(output: Path, card, num_frames: Optional[int]) -> None:
    """ValueError naming --output when the file cannot hold what the card makes (an image file for a
    video), before anything loads."""
    from fvgraph.media_file import IMAGE_SUFFIXES

    frames = num_frames or card.shapes.default_frames
    if output.suffix.lower() in IMAGE_SUFFIXES and frames > 1:
        raise ValueError(f"--output {output}: card {card.card_id} makes {frames}-frame videos and an image file holds one "
                         f"frame; write .gif or .mp4 (or give --frames 1)")  # fmt: skip


def request_loras(adapters: dict, lora_scale: list[str]) -> dict[str, float] | None:
    """What generate's requests choose: every --lora at 1.0 (a merged one at its merged scale), or --lora-scale's."""
    loaded, merged = adapters["loras"] or {}, adapters["merge_loras"] or {}
    chosen = {name: merged.get(name, 1.0) for name in loaded}
    for item in lora_scale:
        name, _, text = item.partition("=")
        if name not in loaded:
            raise ValueError(f"--lora-scale {item!r}: {name!r} is not a --lora adapter")
        try:
            chosen[name] = float(text)
        except ValueError:
            raise ValueError(f"--lora-scale {item!r} must be NAME=SCALE") from None
    return chosen or None
