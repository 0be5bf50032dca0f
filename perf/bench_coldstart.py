"""Cold start vs warm start: seconds from process start to the first finished request.

    python perf/bench_coldstart.py                 # tiny-wan and wan-cpu-bench on the CPU, -O1, buckets 1,2,4
    python perf/bench_coldstart.py --card wan-cpu-bench --repeats 3
    python perf/bench_coldstart.py --gpu           # Wan 1.3B config, bf16, -O2, buckets 1,4,8, 17x256x256

Each start is a fresh Python process that builds an engine, warms every batch bucket of one shape
(the card's default shape on the CPU; compiling, or loading from the capture cache), and serves one
request:
- cold_jit: no capture cache; inductor compiles in process (what a start without warmup costs);
- cold: an empty capture cache, filled by this start (AOTInductor packages);
- warm: the same capture cache, read by a new process (`--warm-starts N`: N of them, one after the
  other, each a new process; a warm start is cheap next to the cold start that filled the cache).
Every start gets an empty inductor cache of its own, so nothing comes from torch's caches: only the
capture cache is shared. Prints one JSON line per card (starting with fvgraph.perf.method's
provenance) with each start's seconds as min / median / max over `--repeats` runs of the whole
sequence; `warm_over_cold` is the ratio the goal is about, each warm start over the cold start of
its repeat, with the same spread. Each
start's `phases` say where its seconds went (the last repeat): `imports` (spawn to fvgraph's engine
imported), `engine` (the engine built: weights initialized, capture cache opened) and `warmup`
(every bucket compiled or loaded, and the request served).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fvgraph.cards import get_card
from fvgraph.perf.method import CPU_CARD, GPU_CARD, emit, paired_ratio, provenance, spread

CPU_CARDS = ("tiny-wan", CPU_CARD)  # the test card (its steps cost little: start-up dominates) and the bench card

CHILD = """
import json, sys, time
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
imported_at = time.time()
a = json.loads(sys.argv[1])
engine = Engine.from_card(a["card"], opt_level=a["opt_level"], device=a["device"], cache_dir=a["cache_dir"],
                          buckets=BucketSpec(batch_sizes=tuple(a["buckets"])), compile_config=CompileConfig())
built_at = time.time()
[result] = engine.warmup([Request(**a["request"])])
print(json.dumps({"imported_at": imported_at, "built_at": built_at, "first_result_at": time.time(),
                  "status": result.status, "error": result.error,
                  **{k: engine.counters.snapshot()[k] for k in ("compiles", "compile_seconds", "capture_cache_hits", "capture_cache_stores")}}))
"""


def start(args: dict, scratch: Path, timeout: float) -> dict:
    """One fresh process; seconds from spawning it to its first finished request."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=scratch, prefix="inductor-")}
    began = time.time()
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"start failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["status"] != "ok":
        raise SystemExit(f"start served no result ({report['status']}): {report['error']}")
    imported, built, done_at = (report.pop(k) for k in ("imported_at", "built_at", "first_result_at"))
    report["seconds_to_first_result"] = done_at - began
    report["phases"] = {"imports": round(imported - began, 3), "engine": round(built - imported, 3),
                        "warmup": round(done_at - built, 3)}  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--card", action="append", default=None,
                        help=f"Card to start (repeatable). Default: {', '.join(CPU_CARDS)} on the CPU, {GPU_CARD} with --gpu.")
    parser.add_argument("--buckets", default=None, help="Comma-separated batch buckets.")
    parser.add_argument("--skip-cold-jit", action="store_true", help="Leave out the start without capture cache.")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds allowed per start.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of the whole cold_jit / cold / warm sequence.")
    parser.add_argument("--warm-starts", type=int, default=1, help="Warm starts after each cold start.")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warm_starts < 1:
        raise SystemExit(f"--repeats={args.repeats} and --warm-starts={args.warm_starts} must be >= 1")
    for card in args.card or ([GPU_CARD] if args.gpu else CPU_CARDS):
        emit(bench_card(card, args))


def repeated(values: list[float], times: int) -> list[float]:
    """Each repeat's value once per warm start of that repeat, to pair with the warm starts."""
    return [v for v in values for _ in range(times)]


def bench_card(card: str, args: argparse.Namespace) -> dict:
    """The cold_jit / cold / warm sequence `--repeats` times for one card; its result line."""
    if args.gpu:
        frames, height, width = 17, 256, 256
    else:
        shapes = get_card(card).shapes
        frames, height, width = shapes.default_frames, shapes.default_height, shapes.default_width
    child = {
        "card": card,
        "device": "cuda" if args.gpu else "cpu",
        "opt_level": 2 if args.gpu else 1,
        "buckets": [int(b) for b in (args.buckets or ("1,4,8" if args.gpu else "1,2,4")).split(",")],
        "request": dict(prompt="a red fox", num_inference_steps=2, num_frames=frames, height=height, width=width, seed=0),
    }
    runs = {"cold_jit": [], "cold": [], "warm": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="fvgraph-coldstart-") as scratch:
            scratch = Path(scratch)
            if not args.skip_cold_jit:
                runs["cold_jit"].append(start({**child, "cache_dir": None}, scratch, args.timeout))
            cache_dir = str(scratch / "capture_cache")
            runs["cold"].append(start({**child, "cache_dir": cache_dir}, scratch, args.timeout))
            runs["warm"] += [start({**child, "cache_dir": cache_dir}, scratch, args.timeout) for _ in range(args.warm_starts)]
    seconds = {name: [r["seconds_to_first_result"] for r in rs] for name, rs in runs.items() if rs}
    per_warm_start = functools.partial(repeated, times=args.warm_starts)
    report = {**provenance("coldstart", torch.device(child["device"])), **{k: child[k] for k in ("card", "opt_level", "buckets")},
              "shape": [frames, height, width], "warm_starts": args.warm_starts, "seconds_to_first_result": {k: spread(v) for k, v in seconds.items()},
              "counters": {name: rs[-1] for name, rs in runs.items() if rs},
              "warm_over_cold": paired_ratio(seconds["warm"], per_warm_start(seconds["cold"]))}  # fmt: skip
    if "cold_jit" in seconds:
        report["warm_over_cold_jit"] = paired_ratio(seconds["warm"], per_warm_start(seconds["cold_jit"]))
    return report


if __name__ == "__main__":
    main()
