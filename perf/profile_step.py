"""Where a denoise step's time goes, per op: fvgraph's compiled step beside diffusers' eager blocks and
diffusers + compile_repeated_blocks, on the same card, shape and weights as perf/bench_step.py.

    python perf/profile_step.py                          # wan-cpu-bench, -O1, batch 1, 5 steps per case
    python perf/profile_step.py --card flux-cpu-bench --batch 4

Each case runs its warmup steps, then `--steps` steps under torch.profiler (CPU activities; CUDA too
on a GPU), and is summarized per step by category of op: GEMMs (aten mm / addmm / bmm / linear and
the mkldnn / oneDNN kernels inductor calls for them), attention (SDPA), inductor's generated kernels
(fused elementwise and norm code: `cpp_fused_*` / `triton_*`, visible because the script turns on
inductor's kernel profiling before compiling), layout copies (copy_ / clone / contiguous / cat), the
rest of aten, and what the profiler saw of none of those (`host`: Python, the scheduler, dispatch).
Prints one JSON line (fvgraph.perf.method's provenance) with, per case, the wall ms per step, ms and
share per category, and the top ops by self time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from fvgraph.perf.method import emit, provenance

CATEGORIES = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "onednn", "_mkl_", "mkl_linear"),
    "attention": ("scaled_dot_product", "flash_attention", "_efficient_attention", "_cudnn_attention"),
    "inductor_kernels": ("cpp_fused", "triton_", "cpp_kernel"),
    "copies": ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::_to_copy", "aten::index_put", "Memcpy"),
}
CONTAINERS = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph", "aten::linear", "aten::matmul")


def category(name: str) -> str:
    for label, needles in CATEGORIES.items():
        if any(n in name for n in needles):
            return label
    return "other_aten" if name.startswith("aten::") else "unclassified"


def summarize(prof, steps: int, wall_s: float, top: int) -> dict:
    """Self time per category (containers such as a compiled region's wrapper excluded: their self time
    is what ran inside them unaccounted, reported as `host`)."""
    by_cat: dict[str, float] = {}
    ops = []
    for event in prof.key_averages():
        self_us = event.self_cpu_time_total + getattr(event, "self_device_time_total", 0)
        if self_us <= 0:
            continue
        ops.append((event.key, self_us))
        if any(event.key.startswith(c) for c in CONTAINERS if c not in ("aten::linear", "aten::matmul")):
            continue
        label = category(event.key)
        by_cat[label] = by_cat.get(label, 0.0) + self_us
    per_step_ms = wall_s * 1e3 / steps
    counted = sum(by_cat.values()) / 1e3 / steps
    cats = {k: round(v / 1e3 / steps, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    cats["host"] = round(max(per_step_ms - counted, 0.0), 3)
    return {
        "wall_ms_per_step": round(per_step_ms, 3),
        "ms_per_step": cats,
        "share": {k: round(v / per_step_ms, 3) for k, v in cats.items()},
        "top_ops_ms_per_step": {name: round(us / 1e3 / steps, 3) for name, us in sorted(ops, key=lambda kv: -kv[1])[:top]},
    }


def profiled(case, steps: int, warmup: int, device: torch.device, top: int) -> dict:
    for _ in range(warmup):
        if case.before:
            case.before()
        case.run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    wall = 0.0
    with profile(activities=activities) as prof:
        for _ in range(steps):
            if case.before:
                case.before()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            case.run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall += time.perf_counter() - began
    return summarize(prof, steps, wall, top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", default="wan-cpu-bench")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    inductor_config.cpp.enable_kernel_profile = True  # each generated CPU kernel as a profiler event
    device = torch.device("cuda" if args.gpu else "cpu")
    from fvgraph.perf.bench_step import step_workload  # noqa: PLC0415 (the same workload the benchmark times)

    cases = step_workload(args.card, device, args.level, args.batch, steps=args.warmup + args.steps + 2)
    report = {name: profiled(case, args.steps, args.warmup, device, args.top) for name, case in cases.items()}
    emit({**provenance("profile_step", device), "card": args.card, "level": args.level, "batch": args.batch, "cases": report})


if __name__ == "__main__":
    main()
