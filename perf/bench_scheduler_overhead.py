"""Scheduler overhead: time per tick spent outside the compiled step, per batch it runs.

    python perf/bench_scheduler_overhead.py            # CPU, -O1, the inductor-compiled tiny-wan step
    python perf/bench_scheduler_overhead.py --gpu      # CUDA, -O2: the step is a CUDA graph replay

Runs a mix of tiny-wan requests at the smallest shape (different seeds, guidance scales and step
counts; 16 in flight, batch buckets 1/2/4/8) and times everything the engine does around the step
itself: grouping plans, filling static buffers and padding, hoisted values, scattering results,
loop bookkeeping. Timed apart and subtracted: the step (the compiled callable, or on a GPU the
CPU side of a graph replay), the per-request prologue it feeds, request admission (validation,
noise, sampler plan) and finalize (on a GPU that is where the host waits for the device). Prints
JSON: the least and the median overhead of `--repeats` runs, per batch and per request-step.
Target: <= 100 us per batch.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from fvgraph.buckets import BucketSpec
from fvgraph.compiler import CompileConfig
from fvgraph.engine import Engine
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


def request_mix(n: int, steps: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [
        Request(prompt_embeds=torch.randn(32, 32, generator=g), negative_prompt_embeds=torch.randn(32, 32, generator=g),
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
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the mix; min and median reported")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA at -O2 (graph replays)")
    parser.add_argument("--backend", choices=("inductor", "aot_eager", "eager"),
                        help="the step's compile backend, timed apart either way (default: inductor on CPU, "
                             "aot_eager on a GPU, where a replay costs the same whatever compiled it)")  # fmt: skip
    args = parser.parse_args(argv)
    backend = args.backend or ("aot_eager" if args.gpu else "inductor")
    engine = Engine.from_card(
        "tiny-wan", device="cuda" if args.gpu else "cpu", opt_level=2 if args.gpu else 1,
        compile_config=CompileConfig(backend=backend), buckets=BucketSpec(batch_sizes=(1, 2, 4, 8)),
    )  # fmt: skip
    engine.warmup(request_mix(1, args.steps))
    engine.generate(request_mix(args.requests, args.steps))  # every lane's buffers exist before timing
    watch = Stopwatch()
    instrument(engine, watch)
    runs = []
    for _ in range(args.repeats):
        watch.seconds.clear()
        before = engine.counters.snapshot()
        if args.gpu:
            torch.cuda.synchronize()
        began = time.perf_counter()
        results = engine.generate(request_mix(args.requests, args.steps))
        wall = time.perf_counter() - began
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        done = engine.counters.since(before)
        outside = wall - sum(watch.seconds.values())
        runs.append(dict(batches=done["batches"], request_steps=done["compiled_steps"], outside=outside,
                         step=watch.seconds["step"], start=watch.seconds["start"]))  # fmt: skip
    runs.sort(key=lambda r: r["outside"] / r["batches"])
    best, median = runs[0], runs[len(runs) // 2]
    us = lambda run, what, per: round(run[what] / run[per] * 1e6, 1)  # noqa: E731
    print(json.dumps({
        "device": "cuda" if args.gpu else "cpu", "opt_level": engine.opt_level, "backend": backend,
        "requests": args.requests, "batches": best["batches"], "request_steps": best["request_steps"],
        "repeats": args.repeats, "overhead_us_per_batch": us(best, "outside", "batches"),
        "overhead_us_per_batch_median": us(median, "outside", "batches"),
        "overhead_us_per_request_step": us(best, "outside", "request_steps"),
        "step_us_per_batch": us(best, "step", "batches"), "target_us_per_batch": 100,
        "start_us_per_request": round(best["start"] / args.requests * 1e6, 1),
        "replays": engine.counters.replays,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
