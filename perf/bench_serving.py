"""Serving throughput: a mix of requests through fvgraph -O0 / -O1 / -O2 vs diffusers WanPipeline one
request at a time (eager, and with compile_repeated_blocks), same weights, side by side in one run.

    python perf/bench_serving.py                   # tiny-wan on the CPU (O2 = O1 there: no CUDA graphs)
    python perf/bench_serving.py --gpu             # Wan 1.3B config, bf16, 256x256x17

The mix: N requests with different seeds, guidance scales and step counts, at two resolutions.
Prompt embeddings are given (the text encoder is not what is measured); outputs are latents.
Compile and capture happen in an untimed warmup over the same shapes. Also reports the denoise step
time at batch 1 and at the largest bucket (`denoise_step_ms_O1/O2`: per batch and per request-step,
measured as a difference of two run lengths), and `online`: the same mix arriving over time (Poisson,
at `--load` times the rate diffusers eager serves one at a time), fed to -O2 through Engine.submit /
tick as it arrives, against a FIFO server running diffusers' measured per-request times at the same
arrival times; latency is from arrival to result. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from fvgraph.buckets import BucketSpec
from fvgraph.compiler import CompileConfig
from fvgraph.engine import Engine
from fvgraph.perf import sync
from fvgraph.request import Request
from fvgraph.samplers import diffusers_scheduler


def request_mix(n: int, shapes: list[tuple[int, int, int]], text_len: int, text_dim: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    requests = []
    for i in range(n):
        frames, height, width = shapes[i % len(shapes)]
        pe, ne = (torch.randn(text_len, text_dim, generator=g) for _ in range(2))
        requests.append(Request(
            prompt_embeds=pe, negative_prompt_embeds=ne, seed=i, guidance_scale=3.0 + i % 5,
            num_inference_steps=6 + i % 3 * 2, num_frames=frames, height=height, width=width, output_type="latent",
        ))  # fmt: skip
    return requests



def run_fvgraph(engine: Engine, requests: list[Request], device: torch.device) -> dict:
    sync(device)
    began = time.perf_counter()
    results = engine.generate([r.model_copy() for r in requests])
    sync(device)
    wall = time.perf_counter() - began
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return {"requests_per_s": len(results) / wall, "wall_s": wall, **_percentiles([r.timings["total"] for r in results])}


def _percentiles(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"p50_s": statistics.median(ordered), "p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of n requests arrives: a Poisson process of `rate` per second."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def run_online(engine: Engine, requests: list[Request], arrivals: list[float], device: torch.device) -> dict:
    """Each request submitted once its arrival time has passed, between ticks; latency runs from its
    arrival (not its submit) to its result, so time spent waiting for a tick counts."""
    arrived_at = {r.request_id: t for r, t in zip(requests, arrivals)}
    queue = sorted(zip(arrivals, range(len(requests))))
    latencies, i = [], 0
    sync(device)
    began = time.perf_counter()
    while i < len(queue) or engine.has_work():
        now = time.perf_counter() - began
        while i < len(queue) and queue[i][0] <= now:
            engine.submit(requests[queue[i][1]].model_copy())
            i += 1
        if not engine.has_work():
            time.sleep(queue[i][0] - now)
            continue
        for result in engine.tick():  # finalize copies the latents to the host: the device is done with it
            assert result.ok, result.error
            latencies.append(time.perf_counter() - began - arrived_at[result.request_id])
    return _percentiles(latencies)


def fifo_latencies(service_s: list[float], arrivals: list[float]) -> dict:
    """A server that runs one request at a time, in arrival order, each taking its measured time."""
    free_at, latencies = 0.0, []
    for arrival, service in sorted(zip(arrivals, service_s)):
        free_at = max(free_at, arrival) + service
        latencies.append(free_at - arrival)
    return _percentiles(latencies)


def run_pipeline(pipe, requests: list[Request], device: torch.device) -> dict:
    """diffusers' WanPipeline, one request at a time (its serving model); `service_s` is each request's time."""
    dtype = next(pipe.transformer.parameters()).dtype
    latencies = []
    began = time.perf_counter()
    for r in requests:
        start = time.perf_counter()
        pipe(prompt_embeds=r.prompt_embeds[None].to(device, dtype), negative_prompt_embeds=r.negative_prompt_embeds[None].to(device, dtype),
             guidance_scale=r.guidance_scale, num_inference_steps=r.num_inference_steps, num_frames=r.num_frames,
             height=r.height, width=r.width, generator=torch.Generator().manual_seed(r.seed), output_type="latent")  # fmt: skip
        sync(device)
        latencies.append(time.perf_counter() - start)
    wall = time.perf_counter() - began
    # one at a time: request i waits for every request before it
    waits = [sum(latencies[: i + 1]) for i in range(len(latencies))]
    return {"requests_per_s": len(requests) / wall, "wall_s": wall, **_percentiles(waits), "service_s": latencies}


def denoise_step_ms(engine: Engine, request: Request, batches: tuple[int, ...], device: torch.device,
                    short: int = 4, long: int = 16) -> dict:  # fmt: skip
    """Milliseconds per denoise step with `b` copies of `request` (other seeds) in lockstep, one batch
    per step, for each b in `batches`. Measured as a difference: b requests of `long` steps minus b
    requests of `short` steps, over `long - short` steps, so admission, the per-request prologue and
    finalize cancel out and what is left is the step as served (replay, scheduling, scatter)."""
    out = {}
    for b in batches:
        walls = {}
        for steps in (short, long, short, long):  # the first pair warms up every graph it touches
            group = [request.model_copy(update={"seed": i, "num_inference_steps": steps, "request_id": f"r{i}"})
                     for i in range(b)]
            sync(device)
            began = time.perf_counter()
            results = engine.generate(group)
            sync(device)
            walls[steps] = time.perf_counter() - began
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        per_step = (walls[long] - walls[short]) / (long - short)
        out[str(b)] = {"per_step_ms": round(per_step * 1e3, 3), "per_request_step_ms": round(per_step / b * 1e3, 3)}
    return out


def main(argv: list[str] | None = None) -> None:
    from diffusers import WanPipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--shapes", nargs="*", help="FxHxW each (default: 5x64x64 5x64x96 on CPU; 17x256x256 on GPU)")
    parser.add_argument("--buckets", nargs="*", type=int, help="batch buckets (default: 1 2 4 8 on CPU; 1 4 8 on GPU)")
    parser.add_argument("--load", type=float, default=0.9,
                        help="online arrival rate, as a fraction of diffusers eager's one-at-a-time requests/s")  # fmt: skip
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; run without --gpu for the CPU (tiny-wan) mode")
    device = torch.device("cuda" if args.gpu else "cpu")
    card = "wan2.1-1.3b-bench" if args.gpu else "tiny-wan"
    default_shapes = ["17x256x256"] if args.gpu else ["5x64x64", "5x64x96"]
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or default_shapes)]
    n = args.requests or (16 if args.gpu else 12)
    # every bucket of every shape is one whole-model compile (about 100 s each for Wan 1.3B on an H200)
    buckets = BucketSpec(batch_sizes=tuple(args.buckets or ((1, 4, 8) if args.gpu else (1, 2, 4, 8))))

    eager = Engine.from_card(card, device=device)
    shapes_cfg = eager.card.shapes
    requests = request_mix(n, shapes, shapes_cfg.text_len, eager.facts.text_dim)
    report = {"card": card, "device": torch.cuda.get_device_name(device) if args.gpu else "cpu", "requests": n,
              "shapes": shapes, "results": {}}  # fmt: skip
    report["results"]["fvgraph_O0"] = run_fvgraph(eager, requests, device)
    engines = {}
    for level in (1, 2):
        engine = engines[level] = Engine.from_card(card, device=device, opt_level=level, compile_config=CompileConfig(backend="inductor"), buckets=buckets)
        warm = time.perf_counter()
        # every bucket of every shape, largest first; afterwards serving refuses to compile
        engine.warmup([r.model_copy(update={"num_inference_steps": 2}) for r in requests[: len(shapes)]])
        report[f"warmup_s_O{level}"] = round(time.perf_counter() - warm, 2)
        report["results"][f"fvgraph_O{level}"] = run_fvgraph(engine, requests, device)
        report[f"compiles_O{level}"] = engine.counters.compiles
        # batch 1 and the largest bucket, at the first shape, on the graphs warmed above
        report[f"denoise_step_ms_O{level}"] = denoise_step_ms(engine, requests[0], (1, buckets.max_batch), device)

    # diffusers runs on an untouched copy of the same seeded weights (no fvgraph cache in its forward)
    c = Engine.from_card(card, device=device, projection_cache_bytes=0).loop.components
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(eager.card.recipe.sampler))  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    report["results"]["diffusers_eager"] = run_pipeline(pipe, requests, device)
    rate = args.load * report["results"]["diffusers_eager"]["requests_per_s"]
    arrivals = arrival_times(n, rate)
    online = {"fvgraph_O2": run_online(engines[2], requests, arrivals, device),
              "diffusers_eager_fifo": fifo_latencies(report["results"]["diffusers_eager"]["service_s"], arrivals)}  # fmt: skip
    report["online"] = {"load": args.load, "arrivals_per_s": round(rate, 4), **{
        name: {k: round(v, 4) for k, v in r.items()} for name, r in online.items()}}  # fmt: skip
    report["online"]["p95_ratio_diffusers_eager_vs_O2"] = round(online["diffusers_eager_fifo"]["p95_s"] / online["fvgraph_O2"]["p95_s"], 3)
    c.transformer.compile_repeated_blocks(fullgraph=True)
    run_pipeline(pipe, requests[: len(shapes)], device)  # compile, untimed
    report["results"]["diffusers_compile_repeated_blocks"] = run_pipeline(pipe, requests, device)

    rps = {name: r["requests_per_s"] for name, r in report["results"].items()}
    report["throughput_ratio_vs_diffusers_eager"] = {k: round(v / rps["diffusers_eager"], 3) for k, v in rps.items()}
    for r in report["results"].values():
        r.pop("service_s", None)
        for key in r:
            r[key] = round(r[key], 4)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
