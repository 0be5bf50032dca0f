"""`fvgraph serve`: JSON-lines requests on standard input, or the OpenAI-style HTTP API with --port."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from fvgraph.cli.caching import CACHE_HELP
from fvgraph.cli.model_choice import CARD_OPTION, CHECKPOINT_OPTION, MODEL_ARGUMENT, choose_model
from fvgraph.cli.options import (ARTIFACT_FORMAT_OPTION, BOUNDARY_RATIO_OPTION, CACHE_METHODS_OPTION, DTYPE_OPTION, FLOW_SHIFT_OPTION, LORA_OPTION,
                                 LORA_TARGET_MODULES_OPTION, MAX_LORA_RANK_OPTION, MAX_LORAS_OPTION, MERGE_LORA_OPTION, OFFLOAD_OPTION, VAE_TILING_OPTION, adapter_options,
                                 at_least_one, bindable, cuda_graphs_note, opt_level_option, parse_shape, parse_size,
                                 serving_engine, writable_dir)  # fmt: skip


def serve(
    model: Optional[str] = MODEL_ARGUMENT,
    requests: str = typer.Option("-", "--requests", "-r", help="JSON-lines file of requests; '-' reads standard input."),
    output_dir: Path = typer.Option(Path("outputs/serve"), "--output-dir", "-o", help="Where each request's video or latents go."),
    card: Optional[str] = CARD_OPTION,
    checkpoint: Optional[str] = CHECKPOINT_OPTION,
    opt_level: int = opt_level_option(),
    no_cudagraph: bool = typer.Option(False, "--no-cudagraph", help="At -O2, keep everything but the CUDA graphs."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Run eagerly whatever the opt level."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor (at -O1 and up)."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    max_running: int = typer.Option(16, help="Requests in flight at once; the rest wait, FIFO."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
    cache_dir: Optional[Path] = typer.Option(None, help="Capture cache: load compiled steps from it, store new ones in it."),
    fail_on_recompile: bool = typer.Option(False, help="Compile nothing: steps missing from the cache fail."),
    artifact_format: str = ARTIFACT_FORMAT_OPTION,
    cfg_parallel: Optional[int] = typer.Option(None, "--cfg-parallel", help="2: cond and uncond branches on two processes (docs/parallel.md)."),
    ulysses: Optional[int] = typer.Option(None, "--ulysses", help="Ulysses degree: processes splitting each denoiser call's tokens; divides the head count."),
    dtype: Optional[str] = DTYPE_OPTION,
    flow_shift: Optional[float] = FLOW_SHIFT_OPTION,
    boundary_ratio: Optional[float] = BOUNDARY_RATIO_OPTION,
    lora: list[str] = LORA_OPTION,
    merge_lora: list[str] = MERGE_LORA_OPTION,
    max_loras: Optional[int] = MAX_LORAS_OPTION,
    max_lora_rank: Optional[int] = MAX_LORA_RANK_OPTION,
    lora_target_modules: Optional[str] = LORA_TARGET_MODULES_OPTION,
    vae_tiling: Optional[str] = VAE_TILING_OPTION,
    offload: Optional[str] = OFFLOAD_OPTION,
    video_format: str = typer.Option("gif", "--format", help="gif | mp4 (mp4 is written with PyAV)."),
    fps: int = typer.Option(8),
    port: Optional[int] = typer.Option(None, help="Serve the OpenAI-style HTTP API on this port (0: any free one) instead of JSON lines."),
    host: str = typer.Option("127.0.0.1", help="HTTP: the address to bind (0.0.0.0 to serve other machines)."),
    api_key: Optional[str] = typer.Option(None, envvar="FVGRAPH_API_KEY", help="HTTP: every /v1 and /metrics call must send 'Authorization: Bearer KEY'."),
    max_queue: int = typer.Option(256, help="HTTP: accepted requests not started yet; more get 429 with Retry-After."),
    memory_budget: Optional[str] = typer.Option(None, help="HTTP: memory requests may reserve, e.g. 60GiB (default: 80% of free GPU memory, half of RAM on CPU); each request is charged an estimate of what it holds (docs/serving.md)."),
    retention_s: float = typer.Option(3600.0, help="HTTP: finished videos and their files are deleted this long after they end."),
    drain_timeout: float = typer.Option(30.0, help="HTTP: on SIGTERM, seconds running requests get before they are cancelled."),
    max_body_bytes: int = typer.Option(16 << 20, help="HTTP: larger request bodies get 413."),
    admin_api_key: Optional[str] = typer.Option(None, envvar="FVGRAPH_ADMIN_API_KEY", help="HTTP: the one key adapter loading and unloading, sleep and wake take (without it: the API key)."),
    lora_dir: Optional[Path] = typer.Option(None, "--lora-dir", help="HTTP: the folder POST /v1/loras loads adapter files from (paths relative to it); without it, loading over HTTP is refused."),
    allowed_hosts: list[str] = typer.Option([], "--allowed-hosts", help="HTTP: a Host name the server answers besides localhost, 127.0.0.1 and [::1] (repeatable); bound elsewhere than loopback, the only names it answers. Without it there, any."),
    allowed_origins: list[str] = typer.Option([], "--allowed-origins", help="HTTP: a web origin (scheme://host[:port]) whose pages may call the API (CORS; repeatable; '*': any). Without it: no CORS headers."),
    cache: Optional[str] = typer.Option(None, "--cache", help=CACHE_HELP),
    cache_methods: Optional[str] = CACHE_METHODS_OPTION,
    playground: bool = typer.Option(True, "--playground/--no-playground", help="HTTP: serve the playground page at / (a browser form on the public API)."),
    warmup_shape: list[str] = typer.Option([], "--warmup-shape", help="HTTP: FRAMESxHEIGHTxWIDTH to compile before /ready (repeatable; with --cache-dir, default: the card's shape)."),
    served_model_name: list[str] = typer.Option([], "--served-model-name", help="HTTP: another name `model` may give, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers or sora-2 (repeatable; the card id stays valid)."),
) -> None:
    """Serve MODEL (a card name, a Hub repo id or a local diffusers folder): requests given as JSON lines (Request's fields; {"cancel": ID} cancels), printing one
    JSON answer line per input line (a request's when it ends); or, with --port, the OpenAI videos
    and images API over HTTP (docs/serving.md). Requests arriving mid-run join the running batch."""
    import sys

    from fvgraph.serving.http_cors import check_origins
    from fvgraph.serving.jsonl_server import JsonlServer, StdoutLines
    from fvgraph.media_file import check_video_output

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # What an operator reads: each request as it ends and the throughput (serving/access_log.py), and each
    # compile as it starts and ends (contract/progress.py).
    for name in ("fvgraph.access", "fvgraph.progress"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        if video_format not in ("gif", "mp4"):
            raise ValueError(f"video_format={video_format!r} must be 'gif' or 'mp4'")
        check_video_output(f"video.{video_format}", fps)  # before any work: a bad option must not cost the run
        writable_dir(output_dir, "--output-dir")
        if memory_budget is not None:
            parse_size(memory_budget, "--memory-budget")
        at_least_one(max_body_bytes, "--max-body-bytes", "bytes of the largest request body accepted")
        check_origins(allowed_origins)
        if lora_dir is not None and not lora_dir.is_dir():
            raise ValueError(f"--lora-dir {lora_dir}: not a folder")
        if port is not None:
            bindable(host, port)
        else:  # bytes: each line is decoded alone, so one that is not UTF-8 is rejected without ending the input
            source = sys.stdin.buffer if requests == "-" else open(requests, "rb")  # noqa: SIM115
        choice = choose_model(model, card, checkpoint)
        engine = serving_engine(choice.card, choice.folder, opt_level, no_cudagraph, enforce_eager, compile_backend, disable_pass,
                                 device, cache_dir, fail_on_recompile, max_running=max_running, cache=cache,
                                 cfg_parallel=cfg_parallel, ulysses=ulysses,
                                 dtype=dtype, flow_shift=flow_shift, boundary_ratio=boundary_ratio,
                                 adapters=adapter_options(lora, merge_lora, max_loras, max_lora_rank, lora_target_modules),
                                 cache_methods=cache_methods, vae_tiling=vae_tiling, offload=offload,
                                 artifact_format=artifact_format)  # fmt: skip
        if port is not None:
            from fvgraph.serving.http_server import HttpServer
            from fvgraph.serving.model_names import ServedNames

            http = HttpServer.from_options(
                engine, output_dir, host=host, port=port, api_key=api_key, max_queue=max_queue, memory_budget=memory_budget,
                retention_s=retention_s, drain_timeout_s=drain_timeout, max_body_bytes=max_body_bytes,
                warmup_shapes=[parse_shape(text, "--warmup-shape") for text in warmup_shape], warm_default_shape=cache_dir is not None,
                model_names=ServedNames.of(engine.card.card_id, served_model_name, choice.checkpoint),
                allowed_origins=tuple(allowed_origins), allowed_hosts=tuple(allowed_hosts), lora_dir=lora_dir,
                admin_api_key=admin_api_key,
                playground=playground,
            )  # fmt: skip
        else:
            server = JsonlServer(engine, output_dir, StdoutLines(), video_format=video_format, fps=fps)
    except Exception as err:  # bad card, checkpoint, option or requests file: say why and stop
        Console(stderr=True).print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    for note in (choice.random_weights_note(), cuda_graphs_note(opt_level, device, not no_cudagraph and not enforce_eager)):
        if note is not None:
            Console(stderr=True).print(note, style="yellow", highlight=False, soft_wrap=True)
    if port is not None:
        label = f"{engine.card.card_id} -O{engine.opt_level}"
        http.run(on_started=lambda url: Console(stderr=True).print(started_line(label, url, playground), highlight=False,
                                                                   soft_wrap=True))  # fmt: skip
        return
    with source:
        counts = server.serve(source)
    Console(stderr=True).print("served: " + (", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "nothing"))


def started_line(label: str, url: str, playground: bool) -> str:
    """What `fvgraph serve --port` prints once it listens: the API's URL and, when served, the playground's."""
    return f"serving {label} on {url}/v1" + (f"; the playground: {url}/ in a browser" if playground else "")
