"""The `fvgraph` command line: generate videos, serve JSON-lines requests, warm the capture cache, diff
settings, run the benchmarks, report the environment."""

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

from fvgraph.serving.serve_ray_command import serve_ray
from fvgraph.cli_caching import CACHE_HELP, cache_line, cache_quality, calibrate, card_with_cache

app = typer.Typer(add_completion=False, no_args_is_help=True, help="fvgraph: a compiled runtime for diffusion transformers")
cache_app = typer.Typer(no_args_is_help=True, help="Inspect the on-disk capture cache: ls | verify | clear.")
app.add_typer(cache_app, name="cache")
app.command()(calibrate)
console = Console()
DEFAULT_CACHE_DIR = Path("capture_cache")


def _compile_config(compile_backend: str, disable_pass: list[str], compile_steps: str = "loop"):
    from fvgraph.compile.compiler import CompileConfig
    from fvgraph.passes.manager import PassConfig

    if compile_backend not in ("eager", "aot_eager", "inductor"):
        raise ValueError(f"--compile-backend={compile_backend!r} must be eager, aot_eager or inductor")
    kinds = tuple(name.strip() for name in compile_steps.split(",") if name.strip())
    if not kinds:
        raise ValueError(f"--compile-steps={compile_steps!r} must be 'loop', 'all' or step kind names, comma separated")
    step_kinds = None if compile_steps == "loop" else "all" if compile_steps == "all" else kinds
    return CompileConfig(backend=compile_backend, passes=PassConfig(disabled=tuple(disable_pass)), step_kinds=step_kinds)


def _serving_engine(card: str, checkpoint: Optional[Path], opt_level: int, no_cudagraph: bool, enforce_eager: bool,
                    compile_backend: str, disable_pass: list[str], device: Optional[str], cache_dir: Optional[Path],
                    fail_on_recompile: bool, compile_steps: str = "loop", max_running: int = 16,
                    cache: Optional[str] = None, cfg_parallel: Optional[int] = None,
                    ulysses: Optional[int] = None):  # fmt: skip
    """The engine `generate` and `serve` run, from their shared options."""
    from fvgraph.parallel.config import ParallelConfig
    from fvgraph.runtime.engine import Engine

    parallel = None
    if cfg_parallel is not None or ulysses is not None:  # either flag starts worker processes, even at degree 1
        try:
            parallel = ParallelConfig(cfg=cfg_parallel or 1, ulysses=ulysses or 1)
        except ValueError as err:
            raise ValueError(f"--cfg-parallel must be 1 or 2 and --ulysses at least 1: {err}") from None

    engine = Engine.from_card(
        card_with_cache(card, cache), checkpoint=checkpoint, opt_level=opt_level, device=device, enforce_eager=enforce_eager,
        compile_config=_compile_config(compile_backend, disable_pass, compile_steps), cuda_graphs=not no_cudagraph,
        cache_dir=cache_dir, max_running=max_running, parallel=parallel,
    )  # fmt: skip
    if fail_on_recompile:
        engine.freeze()
    return engine


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
    opt_level: int = typer.Option(0, "-O", "--opt-level", help="0 eager, 1 compiled + batched steps, 2 + CUDA graphs, 3 + FP8 kernels."),
    no_cudagraph: bool = typer.Option(False, "--no-cudagraph", help="At -O2, keep everything but the CUDA graphs."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Run eagerly whatever the opt level."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor (at -O1 and up)."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    compile_steps: str = typer.Option("loop", help="Step kinds to compile: 'loop' (the ones the loop marks), 'all', or names."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
    cache_dir: Optional[Path] = typer.Option(None, help="Capture cache: load compiled steps from it, store new ones in it."),
    fail_on_recompile: bool = typer.Option(False, help="Compile nothing: steps missing from the cache fail."),
    cache: Optional[str] = typer.Option(None, "--cache", help=CACHE_HELP),
    cfg_parallel: Optional[int] = typer.Option(None, "--cfg-parallel", help="2: cond and uncond branches on two processes (docs/parallel.md)."),
    ulysses: Optional[int] = typer.Option(None, "--ulysses", help="Ulysses degree: processes splitting each denoiser call's tokens; divides the head count."),
    output: Path = typer.Option(Path("outputs/video.gif"), "--output", "-o", help=".gif or .mp4; several prompts add _i."),
    fps: int = typer.Option(8),
) -> None:
    """Generate one video per prompt, interleaving the requests step by step, and print a timing table."""
    from fvgraph.request import Request
    from fvgraph.serving.video_io import check_video_output, write_video

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    began = time.perf_counter()
    try:
        check_video_output(output, fps)  # before any work: a bad option must not cost the run
        _writable_dir(output.parent, "--output")
        engine = _serving_engine(card, checkpoint, opt_level, no_cudagraph, enforce_eager, compile_backend, disable_pass,
                                 device, cache_dir, fail_on_recompile, compile_steps, cache=cache,
                                 cfg_parallel=cfg_parallel, ulysses=ulysses)  # fmt: skip
        requests = [
            Request(
                prompt=text, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale, height=height, width=width, num_frames=num_frames, seed=seed + i,
            )
            for i, text in enumerate(prompt)
        ]  # fmt: skip
        engine.loop.check_request(requests[0])  # the card's rules and calibrated settings, before any work
    except Exception as err:  # bad card, checkpoint or request: say why and stop
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    load_s = time.perf_counter() - began

    kinds = engine.loop.step_kinds
    phases = list(dict.fromkeys(kind.phase for kind in kinds.values()))  # the loop's phases, in its order
    stepped = next((kind.phase for kind in kinds.values() if kind.per_inference_step), None)
    total_steps = sum((r.num_inference_steps or engine.card.recipe.default_steps) for r in requests)
    columns = (TextColumn(stepped or "steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("steps", total=total_steps)
        try:
            results = engine.generate(
                requests, on_step=lambda state, kind: bar.advance(task) if kinds[kind].per_inference_step else None
            )
        finally:
            engine.close()  # a parallel engine's worker processes

    title = f"{engine.card.card_id} -O{engine.opt_level} on {engine.loop.components.device} (load {load_s:.2f} s)"
    table = Table(title=title)
    # The loop's phases in its order, "per step" after the phase that runs once per inference step.
    shown = [c for phase in phases for c in ((phase, "per step") if phase == stepped else (phase,))]
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
    table.caption = f"seconds; 'total' is wall time from submit to result; compiles: {c.compiles}, cache hits: {c.cache_hits}"
    console.print(table)
    for path in written:
        console.print(f"wrote {path}")
    if failed:
        raise typer.Exit(1)


@app.command()
def serve(
    requests: str = typer.Option("-", "--requests", "-r", help="JSON-lines file of requests; '-' reads standard input."),
    output_dir: Path = typer.Option(Path("outputs/serve"), "--output-dir", "-o", help="Where each request's video or latents go."),
    card: str = typer.Option("tiny-wan", help="Card name (see `fvgraph env`)."),
    checkpoint: Optional[Path] = typer.Option(None, help="Local diffusers folder with the card's weights."),
    opt_level: int = typer.Option(1, "-O", "--opt-level", help="0 eager, 1 compiled + batched steps, 2 + CUDA graphs, 3 + FP8 kernels."),
    no_cudagraph: bool = typer.Option(False, "--no-cudagraph", help="At -O2, keep everything but the CUDA graphs."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Run eagerly whatever the opt level."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor (at -O1 and up)."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    max_running: int = typer.Option(16, help="Requests in flight at once; the rest wait, FIFO."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
    cache_dir: Optional[Path] = typer.Option(None, help="Capture cache: load compiled steps from it, store new ones in it."),
    fail_on_recompile: bool = typer.Option(False, help="Compile nothing: steps missing from the cache fail."),
    cfg_parallel: Optional[int] = typer.Option(None, "--cfg-parallel", help="2: cond and uncond branches on two processes (docs/parallel.md)."),
    ulysses: Optional[int] = typer.Option(None, "--ulysses", help="Ulysses degree: processes splitting each denoiser call's tokens; divides the head count."),
    video_format: str = typer.Option("gif", "--format", help="gif | mp4 (mp4 is written with PyAV)."),
    fps: int = typer.Option(8),
    port: Optional[int] = typer.Option(None, help="Serve the OpenAI-style HTTP API on this port (0: any free one) instead of JSON lines."),
    host: str = typer.Option("127.0.0.1", help="HTTP: the address to bind (0.0.0.0 to serve other machines)."),
    api_key: Optional[str] = typer.Option(None, envvar="FVGRAPH_API_KEY", help="HTTP: every /v1 and /metrics call must send 'Authorization: Bearer KEY'."),
    max_queue: int = typer.Option(256, help="HTTP: accepted requests not started yet; more get 429 with Retry-After."),
    memory_budget: Optional[str] = typer.Option(None, help="HTTP: memory requests may reserve, e.g. 60GiB (default: 80% of free GPU memory, half of RAM on CPU)."),
    retention_s: float = typer.Option(3600.0, help="HTTP: finished videos and their files are deleted this long after they end."),
    drain_timeout: float = typer.Option(30.0, help="HTTP: on SIGTERM, seconds running requests get before they are cancelled."),
    max_body_bytes: int = typer.Option(16 << 20, help="HTTP: larger request bodies get 413."),
    cache: Optional[str] = typer.Option(None, "--cache", help=CACHE_HELP),
    warmup_shape: list[str] = typer.Option([], "--warmup-shape", help="HTTP: FRAMESxHEIGHTxWIDTH to compile before /ready (repeatable; with --cache-dir, default: the card's shape)."),
) -> None:
    """Serve requests given as JSON lines (Request's fields; {"cancel": ID} cancels), printing one
    JSON answer line per input line (a request's when it ends); or, with --port, the OpenAI videos
    and images API over HTTP (docs/serving.md). Requests arriving mid-run join the running batch."""
    import sys

    from fvgraph.serving.jsonl_server import JsonlServer, StdoutLines
    from fvgraph.serving.video_io import check_video_output

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if video_format not in ("gif", "mp4"):
            raise ValueError(f"video_format={video_format!r} must be 'gif' or 'mp4'")
        check_video_output(f"video.{video_format}", fps)  # before any work: a bad option must not cost the run
        _writable_dir(output_dir, "--output-dir")
        # Bytes: each line is decoded alone, so one that is not UTF-8 is rejected without ending the input.
        if port is None:
            source = sys.stdin.buffer if requests == "-" else open(requests, "rb")  # noqa: SIM115
        engine = _serving_engine(card, checkpoint, opt_level, no_cudagraph, enforce_eager, compile_backend, disable_pass,
                                 device, cache_dir, fail_on_recompile, max_running=max_running, cache=cache,
                                 cfg_parallel=cfg_parallel, ulysses=ulysses)  # fmt: skip
        if port is not None:
            from fvgraph.serving.http_server import HttpServer

            http = HttpServer.from_options(
                engine, output_dir, host=host, port=port, api_key=api_key, max_queue=max_queue, memory_budget=memory_budget,
                retention_s=retention_s, drain_timeout_s=drain_timeout, max_body_bytes=max_body_bytes,
                warmup_shapes=[_shape(text, "--warmup-shape") for text in warmup_shape], warm_default_shape=cache_dir is not None,
            )  # fmt: skip
        else:
            server = JsonlServer(engine, output_dir, StdoutLines(), video_format=video_format, fps=fps)
    except Exception as err:  # bad card, checkpoint, option or requests file: say why and stop
        Console(stderr=True).print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    if port is not None:
        label = f"{engine.card.card_id} -O{engine.opt_level}"
        http.run(on_started=lambda url: Console(stderr=True).print(f"serving {label} on {url}/v1", highlight=False))
        return
    with source:
        counts = server.serve(source)
    Console(stderr=True).print("served: " + (", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "nothing"))


# `fvgraph serve-ray`: the same HTTP API from N engine replicas on Ray Serve (it imports Ray only when run).
app.command("serve-ray")(serve_ray)


def _writable_dir(folder: Path, option: str) -> None:
    """ValueError naming the option unless `folder` exists (or can be made) and takes new files."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".fvgraph-write-probe-"):
            pass
    except OSError as err:
        raise ValueError(f"{option}: cannot write into {folder}: {err}") from None


def _shape(text: str, option: str = "--shape") -> tuple[int, int, int]:
    try:
        frames, height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{option}={text!r} must be FRAMESxHEIGHTxWIDTH, e.g. 5x64x64") from None
    return frames, height, width


@app.command()
def warmup(
    card: str = typer.Option("tiny-wan", help="Card name (see `fvgraph env`)."),
    checkpoint: Optional[Path] = typer.Option(None, help="Local diffusers folder with the card's weights."),
    cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache."),
    opt_level: int = typer.Option(2, "-O", "--opt-level", help="1 compiled steps; 2 + CUDA graphs (captured at every start); 3 + FP8 kernels."),
    buckets: str = typer.Option("1,2,4,8", help="Batch buckets, comma separated."),
    shape: list[str] = typer.Option([], "--shape", help="FRAMESxHEIGHTxWIDTH (repeatable). Default: the card's default shape."),
    guidance: list[float] = typer.Option([], "--guidance", help="Repeatable: >1 warms the CFG step, 1 the plain one. Default: the card's."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
) -> None:
    """Compile the compiled step kinds of every shape and batch bucket into the capture cache, so later
    processes (`generate --cache-dir`, `Engine.from_card(cache_dir=...)`) start without compiling."""
    from fvgraph.runtime.buckets import BucketSpec
    from fvgraph.cards import get_card
    from fvgraph.request import Request
    from fvgraph.runtime.engine import Engine
    from fvgraph.runtime.opt_levels import compiling_levels

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    began = time.perf_counter()
    try:

        if opt_level not in compiling_levels():
            *others, last = (f"-O{n}" for n in compiling_levels())
            raise ValueError(f"-O{opt_level}: warmup compiles, so it takes {', '.join(others)} or {last}")
        _writable_dir(cache_dir, "--cache-dir")  # a warmup that can store nothing is no warmup
        model = get_card(card)
        rules = model.shapes
        shapes = [_shape(text) for text in shape] or [(rules.default_frames, rules.default_height, rules.default_width)]
        spec = BucketSpec(batch_sizes=tuple(int(b) for b in buckets.split(",")), shapes=tuple(shapes))
        scales, steps = guidance or [model.recipe.default_guidance_scale], model.recipe.allowed_steps[0]
        for f, h, w in shapes:  # the card's limits, before loading anything
            for g in scales:
                Request(prompt="warmup", num_frames=f, height=h, width=w, guidance_scale=g, num_inference_steps=steps).resolve(model)
        engine = Engine.from_card(
            model, checkpoint=checkpoint, opt_level=opt_level, device=device, cache_dir=cache_dir, buckets=spec,
            compile_config=_compile_config(compile_backend, disable_pass),
        )  # fmt: skip
        requests = [engine.loop.warmup_request(f, h, w, g, steps) for f, h, w in shapes for g in scales]
    except Exception as err:  # bad card, shape or bucket list: say why and stop
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    columns = (TextColumn("buckets"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("buckets", total=len(requests) * len(spec.batch_sizes))
        results = engine.warmup(requests, on_bucket=lambda batch: bar.advance(task))
    c = engine.counters
    console.print(
        f"warm: {len(engine.compiler.signatures)} step graphs ({c.compiles} compiled, {c.cache_hits} loaded, "
        f"{c.cache_rejects} rejected and rebuilt) in {time.perf_counter() - began:.1f} s -> {engine.compiler.cache.dir}"
    )
    failed = [r for r in results if not r.ok]
    for result in failed:
        console.print(f"[red]{result.request_id} {result.status}:[/red] {result.error}")
    unstored = [s for s in engine.compiler.signatures if engine.compiler.cache.find(s.key()) is None]
    for signature in unstored:
        console.print(f"[red]not stored in the capture cache:[/red] {signature.step_kind} batch {signature.batch} "
                      f"({signature.key()}); see the warnings above")  # fmt: skip
    if failed or unstored:
        raise typer.Exit(1)


@cache_app.command("ls")
def cache_ls(
    cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifests as JSON."),
) -> None:
    """List every fingerprint directory and its entries."""
    from fvgraph.compile.capture_cache import cache_dirs, leftovers
    from fvgraph.compile.capture_cache_files import size_of

    caches = cache_dirs(cache_dir)
    if as_json:
        listing = {c.dir.name: {"fingerprint": c.fingerprint, "entries": c.entries(), "problems": c.problems,
                                "orphans": [str(p.relative_to(c.dir)) for p in leftovers(c)]} for c in caches}  # fmt: skip
        typer.echo(json.dumps(listing, indent=1))
        return
    if not caches:
        console.print(f"{cache_dir}: empty")
    for cache in caches:
        fp = cache.fingerprint
        title = (f"{cache.dir.name}: {fp.get('card_id')} -O{fp.get('opt_level')} {fp.get('backend')} torch {fp.get('torch')} "
                 f"gpu {fp.get('gpu')} passes {fp.get('pass_pipeline')}")  # fmt: skip
        table = Table(title=title)
        for column in ("signature", "step", "batch", "latents", "MB", "compile s", "capture s"):
            table.add_column(column)
        for key, record in sorted(cache.entries().items(), key=lambda kv: str(kv[1]["factors"].get("step_kind"))):
            factors, meta = record["factors"], record["meta"]
            inputs = (factors.get("shape") or {}).get("inputs") if isinstance(factors.get("shape"), dict) else None
            latents = next((i[1] for i in inputs or [] if isinstance(i, list) and i[:1] == ["latents"]), "-")
            size = sum(a["bytes"] for a in record["artifacts"].values()) / 1e6
            capture, compile_s = meta.get("capture_seconds"), meta.get("compile_seconds")
            table.add_row(key, str(factors.get("step_kind")), str(factors.get("batch")), str(latents), f"{size:.1f}",
                          _seconds(compile_s, 1), _seconds(capture, 3))  # fmt: skip
        console.print(table)
        for problem in cache.problems:
            console.print(f"[red]{cache.dir.name}:[/red] {problem}")
        left = leftovers(cache)
        if left:
            console.print(f"[yellow]{cache.dir.name}: {len(left)} orphaned files ({sum(map(size_of, left)) / 1e6:.1f} MB) "
                          "no entry uses (a killed warmup's staging, replaced artifacts): `fvgraph cache verify` "
                          "names them, `fvgraph cache clear` removes them[/yellow]")  # fmt: skip


def _seconds(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


@cache_app.command("verify")
def cache_verify(cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache.")) -> None:
    """Check every entry's artifacts against the sizes and sha256 in its manifest, load each one as a
    serving process would, and look for orphaned files. Exits 1 on a problem."""
    from fvgraph.compile.capture_cache import cache_dirs, verify

    problems = verify(cache_dir)
    for line in problems:
        console.print(f"[red]bad:[/red] {line}")
    count = sum(len(c.entries()) for c in cache_dirs(cache_dir))
    if problems:
        raise typer.Exit(1)
    console.print(f"ok: {count} entries verified under {cache_dir}")


@cache_app.command("clear")
def cache_clear(
    cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask."),
) -> None:
    """Remove every fingerprint directory under the cache root."""
    from fvgraph.compile.capture_cache import clear

    if not yes and not typer.confirm(f"remove every compiled step under {cache_dir}?"):
        raise typer.Exit(1)
    console.print(f"removed {clear(cache_dir)} fingerprint directories from {cache_dir}")


@app.command()
def parity(
    card: str = typer.Option("tiny-wan"),
    checkpoint: Optional[Path] = typer.Option(None, help="Local diffusers folder with the card's weights."),
    opt_level: int = typer.Option(1, "-O", "--opt-level", help="The setting under test."),
    against: str = typer.Option("0", help="The reference opt level; 'none' (with --cache): the same level uncached."),
    compile_backend: str = typer.Option("inductor"),
    disable_pass: list[str] = typer.Option([], "--disable-pass"),
    prompt: list[str] = typer.Option(["a red fox running through fresh snow", "waves at dusk"], "--prompt", "-p"),
    num_inference_steps: int = typer.Option(4, "--steps"),
    num_frames: int = typer.Option(5, "--frames"),
    device: Optional[str] = typer.Option(None),
    report: Optional[Path] = typer.Option(None, help="Write the JSON-lines report here."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Step caching on both sides (METHOD[:k=v,...]); with "
                                        "--against none, the distance of the cached run from the uncached one."),
) -> None:
    """Diff two settings tap by tap (every block, both CFG branches, predictions, latents) per step.
    Exits 1 when a tap exceeds the card's tolerance, naming the first divergence. With `--cache ...
    --against none`: report how far the cached run lands from the uncached one (relative L2 of the
    latents per step, PSNR of the frames); reported, not asserted."""
    from fvgraph.parity import Setting, compare
    from fvgraph.request import Request

    try:
        from fvgraph.runtime.opt_levels import opt_level as level_config

        if against == "none" and cache is None:
            raise ValueError("--against none compares a cached run with the uncached one: give --cache METHOD[:k=v,...]")
        reference = None if against == "none" else _level(against, "--against")
        for level in (opt_level, reference if reference is not None else opt_level):
            level_config(level)
        requests = [
            Request(prompt=text, seed=i, guidance_scale=5.0 - i, num_inference_steps=num_inference_steps, num_frames=num_frames,
                    cache=cache)  # fmt: skip
            for i, text in enumerate(prompt)
        ]
        if report is not None:
            _writable_dir(report.parent, "--report")  # the report is written after the whole comparison
        if reference is None:
            cache_quality(card, checkpoint, opt_level, compile_backend, disable_pass, device, requests, cache, report)
            return
        b = Setting(opt_level, compile_backend, tuple(disable_pass))
        result = compare(card, requests, Setting(reference, compile_backend), b, checkpoint=checkpoint, device=device)
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


def _level(text: str, option: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{option}={text!r} must be an opt level (0-3) or 'none'") from None


BENCHMARKS = {
    "step": "bench_step", "serving": "bench_serving", "scheduler": "bench_scheduler_overhead",
    "projection-cache": "bench_projection_cache", "coldstart": "bench_coldstart", "kernels": "bench_kernels",
    "http": "bench_http", "interceptors": "bench_interceptors",
}  # fmt: skip


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context, name: str = typer.Argument(..., help=f"One of: {', '.join(BENCHMARKS)}.")) -> None:
    """Run one of the perf/ benchmarks; it prints JSON. Everything after NAME is its own options
    (`fvgraph bench step --gpu`; its own help: `fvgraph bench kernels -- --help`)."""
    import importlib

    if name not in BENCHMARKS:
        raise typer.BadParameter(f"{name!r} is not a benchmark; choose one of {', '.join(BENCHMARKS)}", param_hint="NAME")
    importlib.import_module(f"fvgraph.perf.{BENCHMARKS[name]}").main(ctx.args)


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
