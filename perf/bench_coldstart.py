"""Cold start vs warm start: seconds from process start to the first finished request, by phase.

    python perf/bench_coldstart.py                 # tiny-wan on the CPU, -O2, 5x32x32, buckets 1,2, the auto format (aoti here)
    python perf/bench_coldstart.py --card wan-cpu-bench --repeats 3
    python perf/bench_coldstart.py --artifact-format standalone  # inductor's standalone artifacts instead
    python perf/bench_coldstart.py --gpu           # Wan 1.3B config, bf16, -O2, buckets 1,4,8, 17x256x256

Each start is a fresh Python process that builds an engine, warms every batch bucket of one shape
(compiling, or loading from the capture cache), and serves one request:
- cold_jit (`--cold-jit`): no capture cache; inductor compiles in process (a start without warmup);
- cold: an empty capture cache, filled by this start (`--artifact-format`: auto by default, the
  engine's own choice: AOTInductor packages on a CPU, standalone artifacts on a GPU);
- warm: the same capture cache, read by a new process that runs frozen (`fail_on_recompile`: a
  compile fails the start); `--warm-starts N`: N of them, one after the other.
Every start gets an empty inductor cache of its own, so nothing comes from torch's caches: only the
capture cache is shared. A standalone artifact's C++ kernels (CPU) are therefore built by g++ at
each warm start's load (fvgraph/compile/graph_artifact.py).

Prints one JSON line per card (starting with fvgraph.perf.method's provenance): each start's
seconds to its first result and each phase as min / median / max over `--repeats` runs of the
whole sequence (fresh processes each), and `warm_over_cold`, each warm start over the cold start of
its repeat. The phases of a start:
- `import_torch`: spawn to `import torch` done (the interpreter's start included);
- `import_fvgraph`: then to fvgraph's engine modules imported;
- `engine`: the engine built (weights initialized, capture cache opened);
- `compile:<kind>@<bucket>`: each step compiled in this start (capture, passes, the backend, and
  with a capture cache the artifact written and loaded back), one phase per step kind and bucket;
- `store`: publishing the artifacts into the capture cache (hashing, renaming, the manifest);
- `warm_load`: loading steps from the capture cache (checks and the loader);
- `warmup`: engine built to the first result, all of the above included, and the request served.
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

CHILD = """
import json, sys, time
a = json.loads(sys.argv[1])
import torch
torch_at = time.time()
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile import capture_cache, compiler
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
imported_at = time.time()
spent = {"store": 0.0, "warm_load": 0.0}
def timed(owner, name, phase):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - began
    setattr(owner, name, wrapper)
timed(capture_cache.CaptureCache, "publish", "store")
timed(compiler.StepCompiler, "_load_cached", "warm_load")
config = compiler.CompileConfig(artifact_format=a["artifact_format"])
engine = Engine.from_card(a["card"], opt_level=a["opt_level"], device=a["device"], cache_dir=a["cache_dir"],
                          buckets=BucketSpec(batch_sizes=tuple(a["buckets"])), compile_config=config)
if a["frozen"]:
    engine.freeze()  # fail_on_recompile: a warm start that compiles fails
built_at = time.time()
[result] = engine.warmup([Request(**a["request"])])
done_at = time.time()
compiled = {f"compile:{s.signature.step_kind}@{s.signature.batch}": s.compile_seconds
            for s in engine.compiler.compiled_steps if s.compile_seconds > 0}
print(json.dumps({"torch_at": torch_at, "imported_at": imported_at, "built_at": built_at, "first_result_at": done_at,
                  "status": result.status, "error": result.error, "timed": {**compiled, **spent},
                  **{k: engine.counters.snapshot()[k] for k in ("compiles", "compile_seconds", "capture_cache_hits",
                                                                "capture_cache_rejects", "capture_cache_stores")}}))
"""


def start(args: dict, scratch: Path, timeout: float) -> dict:
    """One fresh process; seconds from spawning it to its first finished request, and its phases."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=scratch, prefix="inductor-")}
    began = time.time()
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"start failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["status"] != "ok":
        raise SystemExit(f"start served no result ({report['status']}): {report['error']}")
    torch_at, imported, built, done_at = (report.pop(k) for k in ("torch_at", "imported_at", "built_at", "first_result_at"))
    report["seconds_to_first_result"] = done_at - began
    report["phases"] = {"import_torch": torch_at - began, "import_fvgraph": imported - torch_at, "engine": built - imported,
                        **report.pop("timed"), "warmup": done_at - built}  # fmt: skip
    label = "warm" if args["frozen"] else "cold" if args["cache_dir"] else "cold_jit"
    print(f"phases {label} ({report['seconds_to_first_result']:.1f} s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in report["phases"].items()), flush=True)  # seen as it goes
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--card", action="append", default=None,
                        help=f"Card to start (repeatable). Default: tiny-wan on the CPU, {GPU_CARD} with --gpu.")
    parser.add_argument("--buckets", default=None, help="Comma-separated batch buckets (default: 1,2 on the CPU, 1,4,8 with --gpu).")
    parser.add_argument("--shape", default=None, help="FRAMESxHEIGHTxWIDTH (default: 5x32x32 for tiny-wan, else the "
                                                      "card's default shape; 17x256x256 with --gpu).")  # fmt: skip
    parser.add_argument("-O", "--opt-level", type=int, default=2)
    parser.add_argument("--artifact-format", default="auto", choices=("auto", "standalone", "aoti"))
    parser.add_argument("--cold-jit", action="store_true", help="Also a start without capture cache, before the cold one.")
    parser.add_argument("--skip-cold-jit", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old commands
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds allowed per start.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of the whole cold_jit / cold / warm sequence.")
    parser.add_argument("--warm-starts", type=int, default=1, help="Warm starts after each cold start.")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warm_starts < 1:
        raise SystemExit(f"--repeats={args.repeats} and --warm-starts={args.warm_starts} must be >= 1")
    for card in args.card or ([GPU_CARD] if args.gpu else ["tiny-wan"]):
        emit(bench_card(card, args))


def repeated(values: list[float], times: int) -> list[float]:
    """Each repeat's value once per warm start of that repeat, to pair with the warm starts."""
    return [v for v in values for _ in range(times)]


def shape_of(card: str, args: argparse.Namespace) -> tuple[int, int, int]:
    if args.shape:
        frames, height, width = (int(n) for n in args.shape.lower().split("x"))
        return frames, height, width
    if args.gpu:
        return 17, 256, 256
    if card == "tiny-wan":
        return 5, 32, 32
    shapes = get_card(card).shapes
    return shapes.default_frames, shapes.default_height, shapes.default_width


def phase_spreads(reports: list[dict]) -> dict:
    """Each phase's seconds as min / median / max over the starts that had it."""
    names = list(dict.fromkeys(name for r in reports for name in r["phases"]))
    return {name: spread([r["phases"][name] for r in reports if name in r["phases"]]) for name in names}


def bench_card(card: str, args: argparse.Namespace) -> dict:
    """The (cold_jit /) cold / warm sequence `--repeats` times for one card; its result line."""
    frames, height, width = shape_of(card, args)
    child = {
        "card": card, "device": "cuda" if args.gpu else "cpu", "opt_level": args.opt_level, "artifact_format": args.artifact_format,
        "buckets": [int(b) for b in (args.buckets or ("1,4,8" if args.gpu else "1,2")).split(",")], "frozen": False,
        "request": dict(prompt="a red fox", num_inference_steps=2, num_frames=frames, height=height, width=width, seed=0),
    }  # fmt: skip
    runs = {"cold_jit": [], "cold": [], "warm": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="fvgraph-coldstart-") as scratch:
            scratch = Path(scratch)
            if args.cold_jit:
                runs["cold_jit"].append(start({**child, "cache_dir": None}, scratch, args.timeout))
            cache_dir = str(scratch / "capture_cache")
            runs["cold"].append(start({**child, "cache_dir": cache_dir}, scratch, args.timeout))
            warm = {**child, "cache_dir": cache_dir, "frozen": True}
            runs["warm"] += [start(warm, scratch, args.timeout) for _ in range(args.warm_starts)]
    seconds = {name: [r["seconds_to_first_result"] for r in rs] for name, rs in runs.items() if rs}
    per_warm_start = functools.partial(repeated, times=args.warm_starts)
    report = {**provenance("coldstart", torch.device(child["device"])),
              **{k: child[k] for k in ("card", "opt_level", "artifact_format", "buckets")}, "shape": [frames, height, width],
              "warm_starts": args.warm_starts, "seconds_to_first_result": {k: spread(v) for k, v in seconds.items()},
              "phases": {name: phase_spreads(rs) for name, rs in runs.items() if rs},
              "counters": {name: {k: v for k, v in rs[-1].items() if k != "phases"} for name, rs in runs.items() if rs},
              "warm_over_cold": paired_ratio(seconds["warm"], per_warm_start(seconds["cold"]))}  # fmt: skip
    if "cold_jit" in seconds:
        report["warm_over_cold_jit"] = paired_ratio(seconds["warm"], per_warm_start(seconds["cold_jit"]))
    return report


if __name__ == "__main__":
    main()
