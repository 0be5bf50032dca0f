"""Ray Serve: N engine replicas behind the HTTP API of `fvgraph serve --port` (needs `fvgraph[ray]`).

    from ray import serve
    from fvgraph.serving.ray_deployment import ReplicaSpec, build_app

    spec = ReplicaSpec(card="wan2.1-t2v-1.3b", checkpoint="/models/Wan2.1-T2V-1.3B-Diffusers", opt_level=2,
                       storage_dir="/mnt/shared/fvgraph-videos")
    serve.run(build_app(spec, num_replicas=4, ray_actor_options={"num_gpus": 1}), name="fvgraph", route_prefix="/")

A replica is one Ray Serve replica of the `EngineReplica` deployment: a process with its own Engine
(built from the spec's card, checkpoint, opt level and Engine.from_card keyword arguments), its own
AsyncEngine thread, admission budget and metrics, and the same FastAPI app `fvgraph serve --port` runs
(fvgraph.serving.http_app), installed as the deployment's ASGI ingress. Ray Serve's proxy routes each
HTTP call to a replica and scales them as `num_replicas` or `autoscaling_config` say; a POST runs on the
replica that took it. Videos live in one SharedVideoStore directory that every replica sees, so a GET,
list, content or DELETE call may land on any replica (fvgraph.serving.shared_video_store). Every
response carries the `fvgraph-replica` header naming the replica that answered it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

try:
    from ray import serve
except ImportError as err:  # the optional extra
    raise ImportError(
        "fvgraph's Ray Serve deployment needs Ray Serve: install the ray extra, pip install 'fvgraph[ray]'"
    ) from err

from fvgraph.serving.admission import Admission
from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.serving.http_app import HttpSettings, create_app
from fvgraph.serving.memory_reservation import MemoryModel, default_budget
from fvgraph.serving.shared_video_store import SharedVideoStore

log = logging.getLogger(__name__)
REPLICA_HEADER = "fvgraph-replica"
DEFAULT_MAX_ONGOING_REQUESTS = 256  # HTTP calls a replica serves at once (polls, event streams, posts)
# Engine.from_card's arguments that ReplicaSpec names itself; engine_kwargs takes the others.
_NAMED = {"card", "checkpoint", "opt_level", "device", "cache_dir"}


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: its engine, and the HTTP front of `fvgraph serve --port` over it."""

    storage_dir: str  # the shared video store: a directory every replica sees (a network file system across machines)
    card: str = "tiny-wan"
    checkpoint: str | None = None  # a local diffusers folder, at the same path on every replica's machine
    opt_level: int = 1
    device: str | None = None  # None: cuda when the replica sees a GPU (ray_actor_options num_gpus), else cpu
    cache_dir: str | None = None  # capture cache; with one, replicas load the compiled steps instead of compiling
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # Engine.from_card's other keyword arguments
    freeze: bool = False  # compile nothing while serving (steps missing from cache_dir fail), as --fail-on-recompile
    settings: HttpSettings = HttpSettings()  # API key, body limit, retention, drain timeout, warmup requests
    max_queue: int = 256  # per replica: accepted requests not started yet; more get 429
    memory_budget: int | None = None  # per replica, bytes; None: the device's default

    def __post_init__(self) -> None:
        if not str(self.storage_dir).strip():
            raise ValueError("storage_dir must name a directory every replica can write (the shared video store)")
        if self.opt_level not in (0, 1, 2, 3):
            raise ValueError(f"opt_level={self.opt_level} must be 0, 1, 2 or 3")
        if repeated := sorted(_NAMED & set(self.engine_kwargs)):
            raise ValueError(f"engine_kwargs repeats {repeated}: give them as ReplicaSpec's own fields")
        if self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue} must be at least 1")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget={self.memory_budget} must be a positive number of bytes")

    def build_engine(self):
        """The replica's Engine (Engine.from_card with the spec's arguments)."""
        from fvgraph.engine.engine import Engine

        engine = Engine.from_card(self.card, checkpoint=self.checkpoint, opt_level=self.opt_level, device=self.device,
                                  cache_dir=self.cache_dir, **self.engine_kwargs)  # fmt: skip
        if self.freeze:
            engine.freeze()
        return engine


class ReplicaHeader:
    """ASGI middleware: every HTTP response says which replica answered (`fvgraph-replica: ID`)."""

    def __init__(self, app, replica: str):
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_replica(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]
            await send(message)

        await self.app(scope, receive, send_with_replica)


@serve.deployment
@serve.ingress()
class EngineReplica:
    """One replica: an Engine, its AsyncEngine, and the HTTP app over them (built once the engine is)."""

    def __init__(self, spec: ReplicaSpec):
        self.spec = spec
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = spec.build_engine()
        budget = spec.memory_budget or default_budget(self.engine)
        admission = Admission(MemoryModel(self.engine), budget, spec.max_queue, self.engine.max_running)
        self.served = AsyncEngine(self.engine, admission)
        self.store = SharedVideoStore(spec.storage_dir, spec.settings.retention_s, owner=self.replica_id,
                                      on_deleted_elsewhere=self._cancel_deleted)  # fmt: skip
        self._cancels: set[asyncio.Task] = set()

    def __serve_build_asgi_app__(self):
        """Ray Serve calls this after __init__: the app of `fvgraph serve --port`, on this replica's engine."""
        app = create_app(self.served, self.store, self.spec.settings)
        app.add_middleware(ReplicaHeader, replica=self.replica_id)
        return app

    def _cancel_deleted(self, video_id: str) -> None:
        """Another replica deleted one of this replica's videos: cancel it at its next step boundary.
        The store calls this from a lookup, and the app looks videos up on its event loop."""
        task = asyncio.get_running_loop().create_task(self.served.cancel(video_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        if self.served.error is not None:
            raise RuntimeError(f"replica {self.replica_id}: the engine thread stopped: {self.served.error!r}")


def build_app(spec: ReplicaSpec, *, num_replicas: int | str | None = None, autoscaling_config: dict | None = None,
              ray_actor_options: dict | None = None, **deployment_options) -> serve.Application:  # fmt: skip
    """The Ray Serve application: `EngineReplica` with Ray Serve's own deployment options passed through
    (num_replicas or autoscaling_config, ray_actor_options such as num_gpus, max_ongoing_requests,
    graceful_shutdown_timeout_s, ...). Run it with `serve.run(app, route_prefix="/")`."""
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both (Ray Serve takes one)")
    if isinstance(num_replicas, int) and num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be at least 1")
    options = dict(deployment_options)  # the store's directory is made by each replica, where it runs
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    if ray_actor_options is not None:
        options["ray_actor_options"] = ray_actor_options
    # Ray Serve's shutdown must outlast the drain, which gives running requests drain_timeout_s to end.
    options.setdefault("graceful_shutdown_timeout_s", spec.settings.drain_timeout_s + 10.0)
    # Ray Serve's default (5 HTTP calls in flight per replica) would hold back polls behind a few open
    # event streams; the engine's load is bounded by admission (max_queue, max_running) instead.
    options.setdefault("max_ongoing_requests", DEFAULT_MAX_ONGOING_REQUESTS)
    return EngineReplica.options(**options).bind(spec)
