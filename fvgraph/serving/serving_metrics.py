"""Prometheus metrics of a served engine (GET /metrics). One registry per server, no global state.

    fvgraph_queue_depth                          accepted requests that have not started (waiting for memory or a place)
    fvgraph_running_requests                     requests that started and have not ended
    fvgraph_memory_reserved_bytes / _budget_bytes  admission's reservations and its budget
    fvgraph_batch_occupancy{step_kind,bucket}    rows used / rows of the bucket, per batch run
    fvgraph_step_seconds{step_kind,bucket}       wall time of one batch of steps (compiles excluded)
    fvgraph_request_seconds{status}              submit to end, by final status (completed, failed, cancelled)
    fvgraph_cancellations_total{reason}          client, timeout, shutdown
    fvgraph_rejections_total{reason}             invalid, memory, queue_full, unauthorized, too_large, draining
    fvgraph_compiles_total, fvgraph_recompiles_total (compiles after the server became ready),
    fvgraph_capture_cache_hits_total, fvgraph_cuda_graph_replays_total, fvgraph_eager_fallbacks_total

`bucket` is the batch bucket a compiled batch ran at, or "eager" for steps run one by one (at -O0, and
the step kinds the compiler leaves eager, such as text encoding and VAE decoding).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.serving.request_events import RequestEvent

_STATUS = {"done": "completed", "failed": "failed", "cancelled": "cancelled"}
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _EngineCounters:
    """Reads the engine's Counters at scrape time (plain ints: safe to read from another thread)."""

    def __init__(self, served: AsyncEngine, metrics: ServingMetrics):
        self.counters = served.engine.counters
        self.metrics = metrics

    def collect(self):
        c = self.counters
        recompiles = 0 if self.metrics.compiles_at_ready is None else c.compiles - self.metrics.compiles_at_ready
        for name, value, doc in (
            ("fvgraph_compiles", c.compiles, "Step graphs compiled (one per signature and bucket)."),
            ("fvgraph_recompiles", recompiles, "Step graphs compiled after the server became ready."),
            ("fvgraph_capture_cache_hits", c.capture_cache_hits, "Compiled steps loaded from the capture cache."),
            ("fvgraph_cuda_graph_replays", c.replays, "CUDA graph replays."),
            ("fvgraph_eager_fallbacks", c.fallbacks, "Steps that wanted a compiled graph and ran eagerly."),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class ServingMetrics:
    def __init__(self, served: AsyncEngine):
        self.registry = registry = CollectorRegistry()
        admission = served.admission
        self.compiler = served.engine.compiler
        self.buckets = served.engine.buckets
        self.compiles_at_ready: int | None = None
        Gauge("fvgraph_queue_depth", "Accepted requests not started yet.", registry=registry).set_function(
            lambda: admission.queue_depth
        )
        Gauge("fvgraph_running_requests", "Requests started and not ended.", registry=registry).set_function(
            lambda: admission.running
        )
        Gauge("fvgraph_memory_reserved_bytes", "Memory reserved by admitted requests.", registry=registry).set_function(
            lambda: admission.reserved_bytes
        )
        Gauge("fvgraph_memory_budget_bytes", "Memory requests may reserve.", registry=registry).set(admission.budget)
        self.batch_occupancy = Histogram(
            "fvgraph_batch_occupancy", "Rows used / rows of the bucket, per batch.", ["step_kind", "bucket"],
            buckets=(0.125, 0.25, 0.5, 0.75, 1.0), registry=registry,
        )  # fmt: skip
        self.step_seconds = Histogram("fvgraph_step_seconds", "Wall time of one batch of steps.", ["step_kind", "bucket"],
                                      buckets=_LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.request_seconds = Histogram("fvgraph_request_seconds", "Submit to end, by final status.", ["status"],
                                         buckets=_LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.cancellations = Counter("fvgraph_cancellations", "Requests cancelled, by reason.", ["reason"], registry=registry)
        self.rejections = Counter("fvgraph_rejections", "Requests refused, by reason.", ["reason"], registry=registry)
        registry.register(_EngineCounters(served, self))
        served.listeners.append(self.on_event)
        served.batch_listeners.append(self.on_batch)

    def ready(self, compiles: int) -> None:
        """The server is warm: compiles from now on count as recompiles."""
        self.compiles_at_ready = compiles

    def on_event(self, event: RequestEvent) -> None:
        if not event.terminal:
            return
        if event.result is not None and "total" in event.result.timings:
            self.request_seconds.labels(_STATUS[event.kind]).observe(event.result.timings["total"])
        if event.kind == "cancelled":
            self.cancellations.labels(event.reason or "client").inc()

    def on_batch(self, step_kind: str, rows: int, seconds: float) -> None:
        if self.compiler is not None and self.compiler.wants(step_kind):
            bucket = self.buckets.batch_for(min(rows, self.buckets.max_batch))
            occupancy = rows / bucket
        else:
            bucket, occupancy = "eager", 1.0
        self.batch_occupancy.labels(step_kind, str(bucket)).observe(occupancy)
        self.step_seconds.labels(step_kind, str(bucket)).observe(seconds)

    def reject(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
