"""`fvgraph serve --port`: the HTTP app on uvicorn, with a shutdown that loses nothing.

    server = HttpServer(engine, HttpSettings(api_key="..."), storage_dir="outputs/http", port=8000)
    server.run()                           # blocks; SIGTERM or Ctrl+C drains, a second one stops at once
    with server.running() as base_url:     # in a thread (tests, benchmarks): "http://127.0.0.1:PORT"
        ...

On SIGTERM (or SIGINT) the server keeps answering: new requests get 503, /ready says draining, and
running requests have `drain_timeout_s` to finish before they are cancelled; once every video's file
is written (or its failure recorded) uvicorn stops. It binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from fvgraph.serving.admission import Admission
from fvgraph.card import ModelCard
from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.engine.engine import Engine
from fvgraph.serving.http_app import HttpSettings, create_app
from fvgraph.serving.http_same_origin import default_allowed_hosts
from fvgraph.serving.memory_reservation import MemoryModel, default_budget
from fvgraph.serving.access_log import AccessLog
from fvgraph.serving.model_names import ServedNames
from fvgraph.request import Request
from fvgraph.serving.video_store import VideoStore

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the engine before the sockets close."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.on_started: Callable[[str], None] | None = None

    @property
    def base_url(self) -> str:
        """http://HOST:PORT as bound (the real port when 0 was asked for)."""
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started(self.base_url)

    def handle_exit(self, sig, frame) -> None:
        if self.draining or self._loop is None:  # a second signal, or one before startup: stop now
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.draining = True
        log.warning("signal %s: draining (new requests get 503); a second signal stops at once", sig)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


class HttpServer:
    def __init__(self, engine: Engine, settings: HttpSettings, storage_dir: str | Path, host: str = "127.0.0.1",
                 port: int = 8000, max_queue: int = 256, memory_budget: int | None = None):  # fmt: skip
        """`port` 0 picks a free one (see `running()`); `memory_budget` in bytes defaults to the
        device's (fvgraph.serving.memory_reservation.default_budget)."""
        budget = memory_budget if memory_budget is not None else default_budget(engine)
        admission = Admission(MemoryModel(engine), budget, max_queue, engine.max_running)
        self.served = AsyncEngine(engine, admission)
        self.access_log = AccessLog(self.served)  # one line per request, throughput every minute (fvgraph.access)
        self.store = VideoStore(storage_dir, settings.retention_s)
        self.app = create_app(self.served, self.store, settings)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                                lifespan="on")  # fmt: skip
        self.server = DrainingServer(config, self.app.state.api.drain)

    @classmethod
    def from_options(cls, engine: Engine, storage_dir: str | Path, *, host: str, port: int, api_key: str | None,
                     max_queue: int, memory_budget: str | None, retention_s: float, drain_timeout_s: float,
                     max_body_bytes: int, warmup_shapes: list[tuple[int, int, int]], warm_default_shape: bool,
                     model_names: ServedNames | None = None, allowed_origins: tuple[str, ...] = (),
                     playground: bool = True, allowed_hosts: tuple[str, ...] = (),
                     lora_dir: str | Path | None = None, admin_api_key: str | None = None) -> HttpServer:  # fmt: skip
        """The server `fvgraph serve --port` builds from its options. `memory_budget` is a size such as
        '60GiB'; with no `warmup_shapes` and `warm_default_shape` (a capture cache was given), the
        card's default shape is warmed before /ready; `model_names` what `model` may name;
        `allowed_origins` may call it from a browser (CORS); `allowed_hosts` are Host names it answers
        besides the loopback ones (fvgraph/serving/http_same_origin.py); `lora_dir` where POST /v1/loras
        loads adapter files from."""
        shapes = list(warmup_shapes)
        if warm_default_shape and not shapes:
            rules = engine.card.shapes
            shapes = [(rules.default_frames, rules.default_height, rules.default_width)]
        settings = HttpSettings(api_key=api_key, admin_api_key=admin_api_key, max_body_bytes=max_body_bytes, retention_s=retention_s,
                                drain_timeout_s=drain_timeout_s, warmup=warmup_requests(engine.card, shapes),
                                model_names=model_names, allowed_origins=tuple(allowed_origins),
                                playground=playground, allowed_hosts=default_allowed_hosts(host, tuple(allowed_hosts)),
                                lora_dir=None if lora_dir is None else Path(lora_dir))  # fmt: skip
        budget = None if memory_budget is None else parse_bytes(memory_budget, "--memory-budget")
        return cls(engine, settings, storage_dir, host=host, port=port, max_queue=max_queue, memory_budget=budget)

    def run(self, on_started: Callable[[str], None] | None = None) -> None:
        """Serve until a signal has drained it; `on_started(base_url)` is called once it listens."""
        self.server.on_started = on_started
        self.server.run()

    @contextmanager
    def running(self, startup_timeout_s: float = 60.0) -> Iterator[str]:
        """Serve on a thread of its own; yields the base URL, stops (draining) on exit."""
        thread = threading.Thread(target=self.server.run, name="fvgraph-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        try:
            yield self.server.base_url
        finally:
            self.server.should_exit = True
            thread.join()


def parse_bytes(text: str, option: str) -> int:
    """'8GiB', '512MiB', '2e9' or a plain number of bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    unit = next((u for u in units if lowered.endswith(u)), "")
    try:
        value = float(lowered[: len(lowered) - len(unit)])
    except ValueError:
        raise ValueError(f"{option}={text!r} must be a size such as 8GiB, 512MiB or 2000000000") from None
    if not value > 0:
        raise ValueError(f"{option}={text!r} must be positive")
    return int(value * units.get(unit, 1))


def warmup_requests(card: ModelCard, shapes: list[tuple[int, int, int]]) -> tuple[Request, ...]:
    """One request per (frames, height, width) at the card's default guidance and fewest steps: what
    Engine.warmup compiles (or loads) every batch bucket for."""
    return tuple(
        Request(prompt="warmup", num_inference_steps=card.recipe.allowed_steps[0], num_frames=f, height=h, width=w,
                guidance_scale=card.recipe.default_guidance_scale, seed=0, request_id=f"warmup-{f}x{h}x{w}")  # fmt: skip
        for f, h, w in shapes
    )
