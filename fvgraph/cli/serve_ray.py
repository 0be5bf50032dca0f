"""`fvgraph serve-ray`: the HTTP API of `fvgraph serve --port` on Ray Serve, with N engine replicas.

The command builds a ReplicaSpec from the same engine and HTTP options as `fvgraph serve --port`,
connects to Ray (or starts a local instance), runs the application, and serves until SIGTERM or
Ctrl+C, then shuts Serve down: each replica drains (running requests get --drain-timeout seconds)
before it stops, and the command exits 0.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from fvgraph.cli.options import CACHE_METHODS_OPTION, opt_level_option


def serve_ray(
    replicas: Optional[int] = typer.Option(None, help="Engine replicas (default 1); or --autoscaling."),
    autoscaling: Optional[str] = typer.Option(None, help='Ray Serve autoscaling_config as JSON, e.g. \'{"min_replicas": 1, "max_replicas": 4}\'.'),
    replica_cpus: float = typer.Option(1.0, help="CPUs Ray reserves for each replica."),
    replica_gpus: float = typer.Option(0.0, help="GPUs Ray reserves for each replica (1 for one GPU each)."),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join ('auto', 'ray://HOST:PORT'; 'local' starts a new one). Default: Ray's own choice."),
    dashboard: bool = typer.Option(False, help="Start Ray's dashboard when this command starts a local Ray instance."),
    ray_cpus: Optional[int] = typer.Option(None, help="CPUs a local Ray instance this command starts may use (default: all)."),
    storage_dir: Path = typer.Option(Path("outputs/http"), "--storage-dir", "-o", help="The video store every replica shares (a network file system across machines)."),
    host: str = typer.Option("127.0.0.1", help="The address Ray Serve's HTTP proxy binds (0.0.0.0 to serve other machines)."),
    port: int = typer.Option(8000, help="The port Ray Serve's HTTP proxy listens on."),
    card: str = typer.Option("tiny-wan", help="Card name (see `fvgraph env`)."),
    checkpoint: Optional[str] = typer.Option(None, help="The card's weights: a Hub repo id (each replica resolves it through its "
                                             "own Hub cache) or a local diffusers folder (the same path on every machine)."),
    opt_level: int = opt_level_option(),
    no_cudagraph: bool = typer.Option(False, "--no-cudagraph", help="At -O2, keep everything but the CUDA graphs."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Run eagerly whatever the opt level."),
    compile_backend: str = typer.Option("inductor", help="eager | aot_eager | inductor (at -O1 and up)."),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="Skip an FX pass by name (repeatable)."),
    max_running: int = typer.Option(16, help="Per replica: requests in flight at once; the rest wait, FIFO."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda ... (default: cuda when the replica sees a GPU)."),
    cache_dir: Optional[Path] = typer.Option(None, help="Capture cache every replica loads compiled steps from."),
    fail_on_recompile: bool = typer.Option(False, help="Compile nothing: steps missing from the cache fail."),
    api_key: Optional[str] = typer.Option(None, envvar="FVGRAPH_API_KEY", help="Every /v1 and /metrics call must send 'Authorization: Bearer KEY'."),
    max_queue: int = typer.Option(256, help="Per replica: accepted requests not started yet; more get 429."),
    memory_budget: Optional[str] = typer.Option(None, help="Per replica: memory requests may reserve, e.g. 60GiB; each request is charged an estimate of what it holds."),
    retention_s: float = typer.Option(3600.0, help="Finished videos and their files are deleted this long after they end."),
    drain_timeout: float = typer.Option(30.0, help="On shutdown, seconds running requests get before they are cancelled."),
    max_body_bytes: int = typer.Option(16 << 20, help="Larger request bodies get 413."),
    cache_methods: Optional[str] = CACHE_METHODS_OPTION,
    warmup_shape: list[str] = typer.Option([], "--warmup-shape", help="FRAMESxHEIGHTxWIDTH each replica compiles before /ready (repeatable; with --cache-dir, default: the card's shape)."),
    allowed_origins: list[str] = typer.Option([], "--allowed-origins", help="A web origin (scheme://host[:port]) whose pages may call the API (CORS; repeatable; '*': any). Without it: no CORS headers."),
    playground: bool = typer.Option(True, "--playground/--no-playground", help="Serve the playground page at / (a browser form on the public API)."),
    served_model_name: list[str] = typer.Option([], "--served-model-name", help="Another name `model` may give, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers or sora-2 (repeatable; the card id stays valid)."),
) -> None:
    """Serve the OpenAI videos and images API (as `fvgraph serve --port`) from N engine replicas on
    Ray Serve, routed and scaled by Ray Serve (docs/parallel.md, "Ray Serve replicas")."""
    from fvgraph.cli.options import (at_least_one, bindable, compile_config, parse_cache_methods, parse_shape, parse_size,
                                     writable_dir)  # fmt: skip

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    err = Console(stderr=True)
    try:
        from fvgraph.serving.ray_deployment import ReplicaSpec, build_app

        if replicas is not None and autoscaling is not None:
            raise ValueError("--replicas and --autoscaling: give one (Ray Serve takes a fixed count or a policy)")
        if ray_cpus is not None and ray_cpus < 1:
            raise ValueError(f"--ray-cpus={ray_cpus} must be at least 1")
        if replicas is not None and replicas < 1:
            raise ValueError(f"--replicas={replicas} must be at least 1")
        at_least_one(max_body_bytes, "--max-body-bytes", "bytes of the largest request body accepted")
        scaling = _autoscaling(autoscaling) if autoscaling is not None else None
        writable_dir(storage_dir, "--storage-dir")
        bindable(host, port)
        spec = ReplicaSpec(
            storage_dir=str(storage_dir.resolve()), card=card, checkpoint=_replica_checkpoint(checkpoint), opt_level=opt_level,
            device=device, cache_dir=_absolute(cache_dir), freeze=fail_on_recompile, max_queue=max_queue,
            engine_kwargs={"compile_config": compile_config(compile_backend, disable_pass), "enforce_eager": enforce_eager,
                           "cuda_graphs": not no_cudagraph, "max_running": max_running,
                           "cache_methods": parse_cache_methods(cache_methods)},
            settings=_http_settings(card, [parse_shape(text, "--warmup-shape") for text in warmup_shape], cache_dir is not None,
                                    served_model_name, checkpoint, api_key=api_key, max_body_bytes=max_body_bytes,
                                    retention_s=retention_s, drain_timeout_s=drain_timeout,
                                    allowed_origins=tuple(allowed_origins), playground=playground),
            memory_budget=None if memory_budget is None else parse_size(memory_budget, "--memory-budget"),
        )  # fmt: skip
        actor = {"num_cpus": replica_cpus, **({"num_gpus": replica_gpus} if replica_gpus else {})}
        app = build_app(spec, num_replicas=replicas if scaling is None else None, autoscaling_config=scaling,
                        ray_actor_options=actor)  # fmt: skip
    except Exception as error:  # a bad option, or Ray missing: say why and stop
        err.print(f"[red]error:[/red] {escape(str(error))}")  # escaped: "fvgraph[ray]" is not markup
        raise typer.Exit(2) from None
    local = {"include_dashboard": dashboard, **({"num_cpus": ray_cpus} if ray_cpus is not None else {})}
    _run(app, ray_address, local, host, port, f"{card} -O{opt_level}", err)


def _run(app, ray_address: Optional[str], local: dict, host: str, port: int, label: str, err: Console) -> None:
    import ray
    from ray import serve

    try:
        ray.init(address=ray_address, log_to_driver=False, configure_logging=False, **local)
    except (ValueError, ConnectionError) as error:  # no cluster at the address; --ray-cpus given for one that runs
        err.print(f"[red]error:[/red] --ray-address={ray_address}: {escape(str(error))}")
        raise typer.Exit(2) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(app, name="fvgraph", route_prefix="/")
        except RuntimeError as error:  # the port was free when checked, and taken before the proxy bound it
            if "Failed to bind" not in str(error):
                raise
            err.print(f"[red]error:[/red] --port={port}: Ray Serve's proxy cannot bind {escape(host)}:{port}: "
                      "another process took it while Ray started")  # fmt: skip
            raise typer.Exit(2) from None
        err.print(f"serving {label} on Ray Serve at http://{host}:{port}/v1", highlight=False)
        stop.wait()
        err.print("stopping: each replica drains, then Ray Serve shuts down", highlight=False)
    finally:
        serve.shutdown()
        ray.shutdown()


def _autoscaling(text: str) -> dict:
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--autoscaling={text!r} must be a JSON object (Ray Serve's autoscaling_config): {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--autoscaling={text!r} must be a JSON object, e.g. '{{\"min_replicas\": 1, \"max_replicas\": 4}}'")
    return config


def _http_settings(card_name: str, shapes, warm_default: bool, aliases: list[str], checkpoint: Optional[str], **fields):
    """HttpSettings as `fvgraph serve --port` makes them: its warmup shapes, the names `model` may
    give (the card id, the aliases, the checkpoint's name), and `fields` as given."""
    from fvgraph.cards import get_card
    from fvgraph.serving.http_app import HttpSettings
    from fvgraph.serving.http_server import warmup_requests
    from fvgraph.serving.model_names import ServedNames

    card = get_card(card_name)
    if warm_default and not shapes:
        shapes = [(card.shapes.default_frames, card.shapes.default_height, card.shapes.default_width)]
    return HttpSettings(warmup=warmup_requests(card, shapes), model_names=ServedNames.of(card.card_id, aliases, checkpoint),
                        **fields)  # fmt: skip


def _replica_checkpoint(checkpoint: Optional[str]) -> Optional[str]:
    """A Hub repo id as given (each replica resolves it), a folder as an absolute path."""
    from fvgraph.models.hub_checkpoint import looks_like_repo_id

    return checkpoint if checkpoint is None or looks_like_repo_id(checkpoint) else _absolute(Path(checkpoint))


def _absolute(path: Optional[Path]) -> Optional[str]:
    """Replicas may run in another working directory: they get absolute paths."""
    return None if path is None else str(path.resolve())
