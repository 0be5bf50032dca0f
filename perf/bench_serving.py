"""Online serving: fvgraph against real diffusers servers on the same arrival trace, swept over offered
loads (requests per second) so each system's saturation point shows.

    python perf/bench_serving.py                   # wan-cpu-bench on the CPU: fvgraph -O1 vs diffusers eager and regional compile
    python perf/bench_serving.py --gpu             # Wan 1.3B config, bf16, 256x256x17, fvgraph -O2
    python perf/bench_serving.py --loads 0.5,1,2,4 # offered loads in requests/s (default: 0.5x to 8x diffusers eager's capacity)

The mix: N requests with different seeds, guidance scales and step counts; prompt embeddings are given
(the text encoder is not what is measured) and outputs are latents. At each offered load the requests
arrive as one Poisson trace (seeded; the same trace of gaps, scaled to the load, for every system)
and each system serves them live as they arrive:

    fvgraph_O{level}                   `Engine.submit` on arrival, `Engine.tick` in between: requests
                                       join the running batch at the next step
    diffusers_eager                    WanPipeline, one request at a time, first come first served
    diffusers_compile_repeated_blocks  the same with `transformer.compile_repeated_blocks(fullgraph=True)`

Each diffusers server runs its own untouched copy of the weights. Latency runs from a request's
arrival to its result; `completed_rps` is N over the time from the trace's start to the last result.
Below its saturation point a system completes at the offered rate and its
latency stays flat; past it the queue grows and latency with it (`keeps_up_to_rps`: the highest load
whose p95 latency is within 2x the system's own at the lowest load). Compiles happen in an untimed warmup. With `--repeats R`
the sweep runs R times, the systems' order rotating at each load (fvgraph.perf.method), and every
figure is the spread over the R runs. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from diffusers import WanPipeline

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.perf.diffusers_baselines import baseline_transformer, untouched_components
from fvgraph.perf.method import emit, provenance, spread, sync
from fvgraph.request import Request
from fvgraph.models.components import diffusers_scheduler


def request_mix(n: int, shapes: list[tuple[int, int, int]], text_len: int, text_dim: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    requests = []
    for i in range(n):
        frames, height, width = shapes[i % len(shapes)]
        pe, ne = (torch.randn(text_len, text_dim, generator=g) for _ in range(2))
        requests.append(Request(
            prompt_embeds=pe, negative_prompt_embeds=ne, seed=i, guidance_scale=3.0 + i % 5,
            num_inference_steps=4 + i % 3, num_frames=frames, height=height, width=width, output_type="latent",
        ))  # fmt: skip
    return requests


def unit_gaps(n: int, seed: int = 0) -> list[float]:
    """Gaps of a Poisson process, scaled to a mean of exactly 1 s so that n requests span n seconds
    and a load of L requests/s (each gap divided by L) offers exactly L."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    return [gap * n / sum(gaps) for gap in gaps]


def arrivals_at(gaps: list[float], load: float) -> list[float]:
    times, t = [], 0.0
    for gap in gaps:
        t += gap / load
        times.append(t)
    return times


def serve_fvgraph(engine: Engine, requests: list[Request], arrivals: list[float], device: torch.device) -> dict:
    """Each request submitted once its arrival time has passed, between ticks."""
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
            time.sleep(max(0.0, queue[i][0] - now))
            continue
        for result in engine.tick():  # finalize copies the latents to the host: the device is done with it
            assert result.ok, result.error
            latencies.append(time.perf_counter() - began - arrived_at[result.request_id])
    return _figures(latencies, time.perf_counter() - began)


def serve_pipeline(pipe: WanPipeline, requests: list[Request], arrivals: list[float], device: torch.device) -> dict:
    """diffusers' serving model: one request at a time, first come first served, live on the trace."""
    dtype = next(pipe.transformer.parameters()).dtype
    latencies = []
    began = time.perf_counter()
    for arrival, r in sorted(zip(arrivals, requests), key=lambda pair: pair[0]):
        now = time.perf_counter() - began
        if now < arrival:
            time.sleep(arrival - now)
        run_pipeline(pipe, r, device, dtype)
        latencies.append(time.perf_counter() - began - arrival)
    return _figures(latencies, time.perf_counter() - began)


def run_pipeline(pipe: WanPipeline, r: Request, device: torch.device, dtype: torch.dtype) -> None:
    pipe(prompt_embeds=r.prompt_embeds[None].to(device, dtype), negative_prompt_embeds=r.negative_prompt_embeds[None].to(device, dtype),
         guidance_scale=r.guidance_scale, num_inference_steps=r.num_inference_steps, num_frames=r.num_frames,
         height=r.height, width=r.width, generator=torch.Generator().manual_seed(r.seed), output_type="latent")  # fmt: skip
    sync(device)


def _figures(latencies: list[float], makespan: float) -> dict:
    ordered = sorted(latencies)
    return {"p50_s": statistics.median(ordered), "p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "completed_rps": len(ordered) / makespan}  # fmt: skip


def build_servers(card: str, device: torch.device, requests: list[Request], level: int, buckets: BucketSpec,
                  shapes: int) -> tuple[dict, dict]:  # fmt: skip
    """The systems, warmed up (compiles untimed): name -> serve(requests, arrivals) -> figures."""
    engine = Engine.from_card(card, device=device, opt_level=level, buckets=buckets, compile_config=CompileConfig(backend="inductor"))
    warm = {}
    began = time.perf_counter()
    # every bucket of every shape, largest first; afterwards serving refuses to compile
    engine.warmup([r.model_copy(update={"num_inference_steps": 2}) for r in requests[:shapes]])
    warm[f"fvgraph_O{level}"] = time.perf_counter() - began
    servers = {f"fvgraph_O{level}": lambda reqs, arr: serve_fvgraph(engine, reqs, arr, device)}
    version, sampler = engine.loop.components.weights_version, engine.card.recipe.sampler
    for kind in ("eager", "compile_repeated_blocks"):
        c = untouched_components(card, device, version)
        pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                           transformer=baseline_transformer(kind, c), scheduler=diffusers_scheduler(sampler))  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        began = time.perf_counter()
        for r in requests[:shapes]:
            run_pipeline(pipe, r, device, next(pipe.transformer.parameters()).dtype)
        warm[f"diffusers_{kind}"] = time.perf_counter() - began
        servers[f"diffusers_{kind}"] = lambda reqs, arr, pipe=pipe: serve_pipeline(pipe, reqs, arr, device)
    return servers, warm


def diffusers_capacity(servers: dict, requests: list[Request]) -> float:
    """diffusers eager's requests/s one at a time (all requests queued at once): sets the default loads."""
    figures = servers["diffusers_eager"](requests, [0.0] * len(requests))
    return figures["completed_rps"]


def run_sweep(servers: dict, requests: list[Request], loads: list[float], repeats: int) -> list[dict]:
    """Every system at every load on the same trace, `repeats` times, the systems' order rotating with
    the load and the repeat; one row per load with each system's figures as spreads."""
    gaps, names = unit_gaps(len(requests)), list(servers)
    runs = {(load, name): [] for load in loads for name in names}
    for repeat in range(repeats):
        for j, load in enumerate(loads):
            arrivals = arrivals_at(gaps, load)
            for k in range(len(names)):
                name = names[(repeat + j + k) % len(names)]
                runs[(load, name)].append(servers[name]([r.model_copy() for r in requests], arrivals))
    return [{"offered_rps": load, **{name: {key: spread([f[key] for f in runs[(load, name)]])
                                            for key in ("p50_s", "p95_s", "completed_rps")} for name in names}}
            for load in loads]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="Wan 1.3B config in bf16 on CUDA, fvgraph -O2")
    parser.add_argument("--card", help="default: wan-cpu-bench on the CPU, wan2.1-1.3b-bench with --gpu")
    parser.add_argument("--shapes", nargs="*", help="FxHxW each (default: the card's default shape; 17x256x256 on GPU)")
    parser.add_argument("--requests", type=int, default=None, help="requests per load (default 10 CPU, 16 GPU)")
    parser.add_argument("--loads", help="offered loads in requests/s, comma separated (default: 0.5, 1, 2, 4 and 8 "
                                        "times diffusers eager's one-at-a-time capacity, measured first)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="runs of the whole sweep")
    parser.add_argument("--buckets", type=int, nargs="*", help="batch buckets (default 1 2 4 CPU, 1 4 8 GPU)")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; run without --gpu for the CPU (wan-cpu-bench) mode")
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats} must be >= 1")
    device = torch.device("cuda" if args.gpu else "cpu")
    card = args.card or ("wan2.1-1.3b-bench" if args.gpu else "wan-cpu-bench")
    rules = get_card(card).shapes
    default_shapes = ["17x256x256"] if args.gpu else [f"{rules.default_frames}x{rules.default_height}x{rules.default_width}"]
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or default_shapes)]
    n = args.requests or (16 if args.gpu else 10)
    level = 2 if args.gpu else 1
    buckets = BucketSpec(batch_sizes=tuple(args.buckets or ((1, 4, 8) if args.gpu else (1, 2, 4))))
    text_dim = get_card(card).components["transformer"].config["text_dim"]  # the seeded card's width
    requests = request_mix(n, shapes, rules.text_len, text_dim)

    servers, warm = build_servers(card, device, requests, level, buckets, len(shapes))
    capacity = diffusers_capacity(servers, requests)
    if args.loads:
        loads = sorted(float(v) for v in args.loads.split(","))
        if any(load <= 0 for load in loads):
            raise SystemExit(f"--loads={args.loads}: every load must be > 0 requests/s")
    else:
        loads = [round(capacity * k, 3) for k in (0.5, 1, 2, 4, 8)]
    names = list(servers)
    sweep = run_sweep(servers, requests, loads, args.repeats)
    emit({
        **provenance("serving", device), "card": card, "requests_per_load": n, "shapes": shapes,
        "steps_per_request": sorted({r.num_inference_steps for r in requests}), "buckets": list(buckets.batch_sizes),
        "repeats": args.repeats, "diffusers_eager_capacity_rps": round(capacity, 3), "sweep": sweep,
        # the highest offered load at which a system's median p95 latency is within 2x its own at the
        # lowest load: past it the queue grows faster than the system drains it
        "keeps_up_to_rps": {name: max(row["offered_rps"] for row in sweep
                                      if row[name]["p95_s"]["median"] <= 2 * sweep[0][name]["p95_s"]["median"])
                            for name in names},
        "warmup_s_including_compile": {k: round(v, 2) for k, v in warm.items()},
    })  # fmt: skip


if __name__ == "__main__":
    main()
