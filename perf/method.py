"""The one benchmark method: how every perf/ benchmark times, compares and reports.

- A *case* is one thing to time (`Case(name, run, before)`): `run()` is the timed call, `before()`
  an untimed preparation (restarting a finished request, admitting a batch).
- Cases compared with each other are timed **interleaved in one process**: after an untimed warmup of
  every case (compiles happen there, timed apart), each round times every case once, and the order
  rotates from round to round, so drift in clocks, thermals or a neighbour's load hits all of them
  alike and no case always runs first.
- Every figure is reported as its spread over the repeats: `{"repeats", "min", "median", "max"}`.
  A ratio between two cases is computed per round (the two samples taken side by side) and reported
  with the same spread, never as one number from one run.
- Every result line starts with `provenance()`: the benchmark, the commit (with `-dirty` when the
  tree has changes), `METHOD_VERSION`, and the machine (CPU model, cores, torch threads, torch
  version, GPU name).

Change `METHOD_VERSION` whenever what is timed or subtracted changes: numbers of different method
versions are not comparable, and a comparison across commits re-measures the old commit with the
current method (interleaved, in one script) rather than quoting an old line.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# 1: the first method that interleaves cases, rotates their order and reports min / median / max.
METHOD_VERSION = 1


@dataclass(frozen=True)
class Case:
    """One thing to time: `run()` timed, `before()` (optional) untimed right before each run."""

    name: str
    run: Callable[[], object]
    before: Callable[[], object] | None = None


def sync(device: torch.device) -> None:
    """Wait for the device before reading a wall clock (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of `run` takes, the device synchronized on both sides."""
    sync(device)
    began = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - began


def interleaved(cases: list[Case], repeats: int, warmup: int, device: torch.device,
                measure: Callable[[Callable[[], object], torch.device], float] = timed) -> tuple[dict, dict]:  # fmt: skip
    """Time `cases` interleaved: `warmup` untimed calls of each (in order), then `repeats` rounds that
    time every case once, the order rotated by one each round. Returns (samples in seconds per case,
    one per round in round order; warmup seconds per case, compiles included). `measure(run, device)`
    takes one sample in seconds: by default one call of `run` (`timed`); a kernel benchmark passes a
    sampler that averages many launches (e.g. triton's do_bench)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    names = [case.name for case in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be distinct, got {names}")
    warm = {}
    for case in cases:
        began = time.perf_counter()
        for _ in range(warmup):
            if case.before is not None:
                case.before()
            case.run()
        sync(device)
        warm[case.name] = time.perf_counter() - began
    samples: dict[str, list[float]] = {name: [0.0] * repeats for name in names}
    for r in range(repeats):
        for k in range(len(cases)):
            case = cases[(r + k) % len(cases)]
            if case.before is not None:
                case.before()
            samples[case.name][r] = measure(case.run, device)
    return samples, warm


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> dict:
    """{"repeats", "min", "median", "max"} of `values` times `scale` (1e3: seconds to ms)."""
    if not values:
        raise ValueError("spread of no values")
    scaled = [v * scale for v in values]
    return {"repeats": len(values), "min": round(min(scaled), digits), "median": round(statistics.median(scaled), digits),
            "max": round(max(scaled), digits)}  # fmt: skip


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict:
    """numerator / denominator per round (samples taken side by side), as a spread."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired_ratio needs one sample per round on each side, got {len(numerator)} and {len(denominator)}")
    return spread([a / b for a, b in zip(numerator, denominator)])


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str:
    """The checkout's commit (`-dirty` with uncommitted changes), else $FVGRAPH_COMMIT, else 'unknown'."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return os.environ.get("FVGRAPH_COMMIT", "unknown")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "")


def machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }  # fmt: skip


def provenance(bench: str, device: torch.device) -> dict:
    """The fields every result line starts with."""
    return {"bench": bench, "commit": commit(), "method_version": METHOD_VERSION, "machine": machine(device)}


GPU_CARD, CPU_CARD = "wan2.1-1.3b-bench", "wan-cpu-bench"


def add_workload_options(parser, gpu_shape: str) -> None:
    """--gpu, --card and --shape, as the single-workload benchmarks take them."""
    parser.add_argument("--gpu", action="store_true", help="Wan 1.3B config in bf16 on CUDA")
    parser.add_argument("--card", help=f"default: {CPU_CARD} on the CPU, {GPU_CARD} with --gpu")
    parser.add_argument("--shape", help=f"HxWxF (default: the card's default shape on CPU, {gpu_shape} on GPU)")
    parser.set_defaults(gpu_shape=gpu_shape)


def workload(args) -> tuple[str, torch.device, tuple[int, int, int]]:
    """(card id, device, (height, width, frames)) from add_workload_options' arguments."""
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; run without --gpu for the CPU mode")
    card = args.card or (GPU_CARD if args.gpu else CPU_CARD)
    text = args.shape or (args.gpu_shape if args.gpu else None)
    if text is None:
        from fvgraph.cards import get_card

        s = get_card(card).shapes
        return card, torch.device("cpu"), (s.default_height, s.default_width, s.default_frames)
    try:
        height, width, frames = (int(v) for v in text.split("x"))
    except ValueError:
        raise SystemExit(f"--shape={text!r} must be HxWxF, e.g. 480x832x33") from None
    return card, torch.device("cuda" if args.gpu else "cpu"), (height, width, frames)


def emit(line: dict) -> None:
    """Print one result line (JSON) and flush, so a long run shows progress."""
    print(json.dumps(line), flush=True)
