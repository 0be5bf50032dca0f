"""Scheduler overhead: time per tick spent outside the compiled step, per batch it runs.

    python perf/bench_scheduler_overhead.py            # CPU, -O1, the inductor-compiled wan-cpu-bench step
    python perf/bench_scheduler_overhead.py --gpu      # CUDA, -O2: the step is a CUDA graph replay

Runs a mix of requests at the smallest shape (1 frame, 32x32: the step is kept short, since it is
subtracted; different seeds, guidance scales and step counts; 16 in flight, batch buckets 1/2/4/8)
and times everything the engine does around the step
itself: grouping plans, filling static buffers and padding, hoisted values, scattering results,
loop bookkeeping. Timed apart and subtracted: the step (the compiled callable, or on a GPU the
CPU side of a graph replay), the per-request prologue it feeds, request admission (validation,
noise, sampler plan) and finalize (on a GPU that is where the host waits for the device). Prints
one JSON line (fvgraph.perf.method): each figure as min / median / max over `--repeats` runs, per
batch and per request-step. Target: <= 100 us per batch. A comparison across commits runs both
commits with this script, alternating, and quotes both spreads.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.runtime.engine import Engine
from fvgraph.perf.method import emit, provenance, spread, sync
from fvgraph.request import Request


class Stopwatch:
    """Seconds spent inside wrapped callables, summed per label."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, label: str, fn):
        def timed(*args):
            began = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[label] += time.perf_counter() - began

        timed.stopwatch = self
        return timed


def request_mix(n: int, steps: int, text_len: int, text_dim: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    embeds = lambda: torch.randn(text_len, text_dim, generator=g)  # noqa: E731
    return [
        Request(prompt_embeds=embeds(), negative_prompt_embeds=embeds(),
                seed=i, guidance_scale=2.0 + i % 4, num_inference_steps=steps - i % 3, num_frames=1, height=32,
                width=32, output_type="latent")  # fmt: skip
        for i in range(n)
    ]


def instrument(engine: Engine, watch: Stopwatch) -> None:
    """Route the step, the prologues, admission and finalize through the stopwatch."""
    runner = engine.executor.runner
    runner._replay = watch.wrap("step", runner._replay)
    for entry in runner._graphs.values():  # the per-request prologue is compiled model work too
        if not hasattr(entry.compiled.prologue_fn, "stopwatch") and entry.compiled.prologue_fn is not None:
            entry.compiled.prologue_fn = watch.wrap("step", entry.compiled.prologue_fn)
    engine.start = watch.wrap("start", engine.start)
    engine.loop.finalize = watch.wrap("finalize", engine.loop.finalize)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", default="wan-cpu-bench", help="the card whose step the engine serves")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the mix")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA at -O2 (graph replays)")
    parser.add_argument("--backend", choices=("inductor", "aot_eager", "eager"),
                        help="the step's compile backend, timed apart either way (default: inductor on CPU, "
                             "aot_eager on a GPU, where a replay costs the same whatever compiled it)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats} must be >= 1")
    backend = args.backend or ("aot_eager" if args.gpu else "inductor")
    device = torch.device("cuda" if args.gpu else "cpu")
    engine = Engine.from_card(
        args.card, device=device, opt_level=2 if args.gpu else 1,
        compile_config=CompileConfig(backend=backend), buckets=BucketSpec(batch_sizes=(1, 2, 4, 8)),
    )  # fmt: skip
    shapes = engine.card.shapes
    mix = lambda: request_mix(args.requests, args.steps, shapes.text_len, engine.facts.text_dim)  # noqa: E731
    engine.warmup(mix()[:1])
    engine.generate(mix())  # every lane's buffers exist before timing
    watch = Stopwatch()
    instrument(engine, watch)
    runs = []
    for _ in range(args.repeats):
        watch.seconds.clear()
        before = engine.counters.snapshot()
        sync(device)
        began = time.perf_counter()
        results = engine.generate(mix())
        sync(device)
        wall = time.perf_counter() - began
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        done = engine.counters.since(before)
        outside = wall - sum(watch.seconds.values())
        runs.append(dict(batches=done["batches"], request_steps=done["compiled_steps"], outside=outside,
                         step=watch.seconds["step"], start=watch.seconds["start"]))  # fmt: skip
    us = lambda what, per: spread([run[what] / run[per] for run in runs], 1e6, 1)  # noqa: E731
    emit({
        **provenance("scheduler_overhead", device), "card": args.card, "opt_level": engine.opt_level,
        "backend": backend, "requests": args.requests, "batches": runs[0]["batches"],
        "request_steps": runs[0]["request_steps"], "overhead_us_per_batch": us("outside", "batches"),
        "overhead_us_per_request_step": us("outside", "request_steps"), "step_us_per_batch": us("step", "batches"),
        "target_us_per_batch": 100, "start_us_per_request": spread([r["start"] / args.requests for r in runs], 1e6, 1),
        "replays": engine.counters.replays,
    })  # fmt: skip


if __name__ == "__main__":
    main()
