"""Cold start vs warm start: seconds from process start to the first finished request.

    python perf/bench_coldstart.py                 # wan-cpu-bench on the CPU, -O1, buckets 1,2,4, 9x128x128
    python perf/bench_coldstart.py --gpu           # Wan 1.3B config, bf16, -O2, buckets 1,4,8, 17x256x256

Each start is a fresh Python process that builds an engine, warms every batch bucket of one shape
(compiling, or loading from the capture cache), and serves one request:
- cold_jit: no capture cache; inductor compiles in process (what a start without warmup costs);
- cold: an empty capture cache, filled by this start (AOTInductor packages);
- warm: the same capture cache, read by a new process.
Every start gets an empty inductor cache of its own, so nothing comes from torch's caches: only the
capture cache is shared. Prints one JSON line (starting with fvgraph.perf.method's provenance) with
each start's seconds as min / median / max over `--repeats` runs of the whole sequence;
`warm_over_cold` is the per-repeat ratio the goal is about, with the same spread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fvgraph.perf.method import emit, paired_ratio, provenance, spread

CHILD = """
import json, sys, time
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
a = json.loads(sys.argv[1])
engine = Engine.from_card(a["card"], opt_level=a["opt_level"], device=a["device"], cache_dir=a["cache_dir"],
                          buckets=BucketSpec(batch_sizes=tuple(a["buckets"])), compile_config=CompileConfig())
[result] = engine.warmup([Request(**a["request"])])
print(json.dumps({"first_result_at": time.time(), "status": result.status, "error": result.error,
                  **{k: engine.counters.snapshot()[k] for k in ("compiles", "compile_seconds", "cache_hits", "cache_stores")}}))
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
    report["seconds_to_first_result"] = report.pop("first_result_at") - began
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--buckets", default=None, help="Comma-separated batch buckets.")
    parser.add_argument("--skip-cold-jit", action="store_true", help="Leave out the start without capture cache.")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds allowed per start.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of the whole cold_jit / cold / warm sequence.")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats} must be >= 1")
    frames, height, width = (17, 256, 256) if args.gpu else (9, 128, 128)
    child = {
        "card": "wan2.1-1.3b-bench" if args.gpu else "wan-cpu-bench",
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
            runs["warm"].append(start({**child, "cache_dir": cache_dir}, scratch, args.timeout))
    seconds = {name: [r["seconds_to_first_result"] for r in rs] for name, rs in runs.items() if rs}
    report = {**provenance("coldstart", torch.device(child["device"])), **{k: child[k] for k in ("card", "opt_level", "buckets")},
              "shape": [frames, height, width], "seconds_to_first_result": {k: spread(v) for k, v in seconds.items()},
              "counters": {name: rs[-1] for name, rs in runs.items() if rs},
              "warm_over_cold": paired_ratio(seconds["warm"], seconds["cold"])}  # fmt: skip
    if "cold_jit" in seconds:
        report["warm_over_cold_jit"] = paired_ratio(seconds["warm"], seconds["cold_jit"])
    emit(report)


if __name__ == "__main__":
    main()
