"""Scheduler overhead: time per tick spent outside the compiled step, per batch it runs.

    python perf/bench_scheduler_overhead.py

Runs a mix of tiny-wan requests at the smallest shape through a compiled (-O1) engine whose steps
are cheap, and times everything the engine does around the step itself: grouping plans, filling
static buffers and padding, hoisted values, scattering results, loop bookkeeping. The step (the
compiled callable, or the graph replay on a GPU) and the per-request prologue it feeds are timed
separately and subtracted. Prints JSON.
Target: <= 100 us per batch.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fvgraph.buckets import BucketSpec
from fvgraph.compiler import CompileConfig
from fvgraph.engine import Engine
from fvgraph.request import Request


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    engine = Engine.from_card(
        "tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="inductor"),
        buckets=BucketSpec(batch_sizes=(1, 2, 4, 8)),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def mix():
        return [
            Request(prompt_embeds=torch.randn(32, 32, generator=g), negative_prompt_embeds=torch.randn(32, 32, generator=g),
                    seed=i, guidance_scale=2.0 + i % 4, num_inference_steps=args.steps - i % 3, num_frames=1,
                    height=32, width=32, output_type="latent")  # fmt: skip
            for i in range(args.requests)
        ]

    engine.warmup(mix()[:1])
    runner = engine.executor.runner
    inside = {"s": 0.0}
    replay = runner._replay

    def timed(fn):
        def run(*args):
            began = time.perf_counter()
            out = fn(*args)
            inside["s"] += time.perf_counter() - began
            return out

        run.timed = True
        return run

    def timed_replay(entry):
        began = time.perf_counter()
        out = replay(entry)
        inside["s"] += time.perf_counter() - began
        return out

    runner._replay = timed_replay
    for entry in runner._graphs.values():  # the per-request prologue is compiled model work too
        if entry.compiled.prologue_fn is not None and not hasattr(entry.compiled.prologue_fn, "timed"):
            entry.compiled.prologue_fn = timed(entry.compiled.prologue_fn)
    start = engine.start
    starting = {"s": 0.0}

    def timed_start(request):  # request admission (validation, noise, sampler plan) is not a tick
        began = time.perf_counter()
        state = start(request)
        starting["s"] += time.perf_counter() - began
        return state

    engine.start = timed_start
    batches_before = engine.counters.batches
    began = time.perf_counter()
    results = engine.generate(mix())
    wall = time.perf_counter() - began - starting["s"]
    assert all(r.ok for r in results)
    batches = engine.counters.batches - batches_before
    print(json.dumps({
        "requests": args.requests, "batches": batches, "wall_s": round(wall, 4), "step_s": round(inside["s"], 4),
        "overhead_us_per_batch": round((wall - inside["s"]) / batches * 1e6, 1),
        "step_us_per_batch": round(inside["s"] / batches * 1e6, 1), "target_us_per_batch": 100,
        "start_us_per_request": round(starting["s"] / args.requests * 1e6, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
