"""Kernel benchmarks: every fvgraph kernel against its torch reference, and against cuBLAS bf16 F.linear /
torch SDPA, at Wan's shapes. One JSON object per (kernel, shape, implementation) on stdout.

    python perf/bench_kernels.py                              # --cpu: small shapes, torch paths only (< 1 min)
    python perf/bench_kernels.py --cpu --triton-interpret     # also the Triton kernels, under the interpreter
    python perf/bench_kernels.py --gpu --out results.jsonl    # Wan-1.3B and Wan-14B shapes on CUDA

Shapes (--gpu): Wan-1.3B (dim 1536, FFN 8960, 12 heads x 128) and Wan-14B (dim 5120, FFN 13824, 40 heads)
at 14040 tokens (480x832x33: 9x30x52 patches) and 1280 tokens (256x256x17), batch 2 (a CFG pair, so the
FFN GEMMs have M = 28080). The implementations of a case are timed interleaved (fvgraph.perf.method,
5 rounds): each record has the time as min / median / max ms, TFLOP/s (GEMMs, attention) or GB/s
(memory-bound kernels) and the % of the H200's measured peak (bf16 matmul 754 TFLOP/s, copy 4.3 TB/s;
FP8 GEMMs can exceed 100% of the bf16 peak) at the median, and `vs_reference` = reference time / this
time per round (> 1 is faster). A GPU sample is triton.testing.do_bench's mean (CUDA events, L2
flushed) or CUDA events over 20 launches; a CPU sample is one call. With nsight-python importable and `ncu` on PATH, --gpu also records Nsight
Compute metrics of the Triton kernel; otherwise one record says why it skipped them. Timing numbers on
the CPU only show that the script runs; they say nothing about the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fvgraph.perf.method import Case as MethodCase, interleaved, paired_ratio, provenance, spread, sync, timed

PEAK_BF16_TFLOPS = 754.0  # H200 bf16 8192^3 matmul, measured outside the project (torch 2.11.0+cu130, standalone probe, 2026-11-29)
PEAK_COPY_TBS = 4.3  # measured device-to-device copy on the H200
BATCH = 2  # a CFG pair


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    name: str
    dim: int
    ffn: int
    heads: int
    head_dim: int = 128


GPU_MODELS = (ModelShapes("wan2.1-1.3b", 1536, 8960, 12), ModelShapes("wan2.1-14b", 5120, 13824, 40))
GPU_TOKENS = (14040, 1280)
CPU_MODELS = (ModelShapes("cpu-small", 128, 256, 2, head_dim=64),)
CPU_TOKENS = (64,)  # small enough for the Triton interpreter to finish in seconds


@dataclasses.dataclass
class Case:
    """One kernel at one shape: implementations by name, the one the others are compared with, and the work."""

    kernel: str
    shape: dict
    impls: dict[str, Callable[[], object]]
    reference: str
    flops: float = 0.0  # compute-bound kernels report TFLOP/s
    bytes: float = 0.0  # memory-bound ones GB/s


def do_bench_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """One GPU sample: triton's do_bench mean over its window (CUDA events, L2 flushed), else 20 launches
    between two CUDA events."""
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100)) / 1e3
    except ImportError:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20 / 1e3


def linear_cases(m: ModelShapes, tokens: int, dtype, device, triton_ok: bool) -> list[Case]:
    """The block's GEMMs: bf16 F.linear (cuBLAS) vs FP8 rowwise (with and without the activation quant)."""
    from fvgraph.kernels.fp8_linear import quantize_rows_fp8, quantize_weight_fp8

    cases = []
    rows = BATCH * tokens
    for name, k, n in (("qkv_proj", m.dim, m.dim), ("ffn_up", m.dim, m.ffn), ("ffn_down", m.ffn, m.dim)):
        x = torch.randn(rows, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
        b = torch.randn(n, device=device, dtype=dtype)
        w_q, w_s = quantize_weight_fp8(w)
        x_q, x_s = quantize_rows_fp8(x)
        impls = {
            "bf16_linear" if dtype == torch.bfloat16 else "linear": lambda x=x, w=w, b=b: F.linear(x, w, b),
            "fp8_linear": lambda x=x, w_q=w_q, w_s=w_s, b=b: torch.ops.fvgraph.fp8_linear(x, w_q, w_s, b),
            "fp8_gemm_prequant": lambda x_q=x_q, x_s=x_s, w_q=w_q, w_s=w_s, b=b: torch.ops.fvgraph.fp8_linear_prequant(
                x_q, x_s, w_q, w_s, b, dtype),
        }  # fmt: skip
        cases.append(Case(f"linear.{name}", {"M": rows, "K": k, "N": n}, impls, next(iter(impls)), flops=2.0 * rows * n * k))
    return cases


def elementwise_cases(m: ModelShapes, tokens: int, dtype, device, triton_ok: bool) -> list[Case]:
    """The fused memory-bound kernel: Triton vs torch reference; bytes = the minimum it must move."""
    from fvgraph.kernels import norm_modulate as nm

    x = torch.randn(BATCH, tokens, m.dim, device=device, dtype=dtype)
    shift, scale = (torch.randn(BATCH, 1, m.dim, device=device) * 0.1 for _ in range(2))
    n, es = x.numel(), x.element_size()
    impls = {"torch_reference": lambda: nm.norm_modulate_quant_reference(x, shift, scale, 1e-6)}
    if triton_ok:
        from fvgraph.kernels.norm_modulate_triton import norm_modulate_quant_triton

        impls["triton"] = lambda: norm_modulate_quant_triton(x, shift, scale, 1e-6)
    return [Case("norm_modulate_quant", {"B": BATCH, "S": tokens, "D": m.dim}, impls, "torch_reference",
                 bytes=float(n * es + n + 4 * n // m.dim))]  # fmt: skip


def attention_cases(m: ModelShapes, tokens: int, dtype, device, triton_ok: bool) -> list[Case]:
    """SDPA per backend and the table's choice (fvgraph/kernels/attention.py); reference = SDPA's default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fvgraph.kernels import attention as at

    q, k, v = (torch.randn(BATCH, tokens, m.heads, m.head_dim, device=device, dtype=dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def pinned(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt)

        return run

    def table_choice():
        with at.sdpa_backend_for(tokens, m.head_dim, dtype, device):
            return F.scaled_dot_product_attention(qt, kt, vt)

    impls = {"sdpa_default": lambda: F.scaled_dot_product_attention(qt, kt, vt), "sdpa_table": table_choice}
    if device.type == "cuda":
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            impls[f"sdpa_{name.split('_')[0].lower()}"] = pinned(getattr(SDPBackend, name))
    shape = {"B": BATCH, "S": tokens, "H": m.heads, "Dh": m.head_dim,
             "table_choice": [b.name for b in at.sdpa_backends(tokens, m.head_dim, dtype, device)][:1]}  # fmt: skip
    return [Case("attention", shape, impls, "sdpa_default", flops=4.0 * BATCH * m.heads * tokens * tokens * m.head_dim)]


def run_case(case: Case, model: str, device: torch.device, repeats: int) -> list[dict]:
    """Times every implementation of one case, interleaved (fvgraph.perf.method); an implementation
    that fails its warm-up call becomes a record with its error."""
    out, usable = [], []
    for impl, fn in case.impls.items():
        try:
            fn()
            sync(device)
        except Exception as e:  # e.g. a pinned SDPA backend that cannot take this shape
            out.append({"kernel": case.kernel, "model": model, "shape": case.shape, "impl": impl,
                        "error": f"{type(e).__name__}: {str(e)[:300]}"})  # fmt: skip
            continue
        usable.append(MethodCase(impl, fn))
    measure = do_bench_seconds if device.type == "cuda" else timed
    samples, _ = interleaved(usable, repeats, warmup=0, device=device, measure=measure)
    ms = {impl: statistics.median(s) * 1e3 for impl, s in samples.items()}
    for impl, s in samples.items():
        rec = {"kernel": case.kernel, "model": model, "shape": case.shape, "impl": impl, "ms": spread(s, 1e3, 4)}
        if case.flops:
            tflops = case.flops / ms[impl] / 1e9
            rec.update(tflops=round(tflops, 1), pct_of_bf16_peak=round(100 * tflops / PEAK_BF16_TFLOPS, 1))
        else:
            gbps = case.bytes / ms[impl] / 1e6
            rec.update(gbps=round(gbps, 1), pct_of_copy_peak=round(100 * gbps / (PEAK_COPY_TBS * 1e3), 1))
        if case.reference in samples:
            rec["vs_reference"] = paired_ratio(samples[case.reference], s)
        out.append(rec)
    return out


def nsight_skip_reason(args) -> str | None:
    """Why Nsight Compute metrics are not collected, or None when they are."""
    if not args.gpu:
        return "CPU run"
    if args.no_nsight:
        return "--no-nsight"
    if importlib.util.find_spec("nsight") is None:
        return "nsight-python is not importable"
    if shutil.which("ncu") is None:
        return "ncu is not on PATH"
    return None


def profile_with_nsight() -> None:
    """--nsight-only: DRAM throughput of the Triton kernel at the Wan-1.3B 14040-token shape.

    nsight-python reruns this script (same arguments) under ncu, so this mode does nothing else.
    """
    import nsight

    from fvgraph.kernels.norm_modulate_triton import norm_modulate_quant_triton

    m, dev = GPU_MODELS[0], torch.device("cuda")
    x = torch.randn(BATCH, GPU_TOKENS[0], m.dim, device=dev, dtype=torch.bfloat16)
    shift, scale = torch.zeros(BATCH, 1, m.dim, device=dev), torch.zeros(BATCH, 1, m.dim, device=dev)
    kernels = {"norm_modulate_quant": lambda: norm_modulate_quant_triton(x, shift, scale, 1e-6)}
    for fn in kernels.values():
        fn()  # compile outside the profiled ranges

    @nsight.analyze.kernel(runs=3, metrics=["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed"])
    def profile(tokens):
        for name, fn in kernels.items():
            with nsight.annotate(name):
                fn()

    for row in profile(GPU_TOKENS[0]).to_dataframe().to_dict("records"):
        print(json.dumps({"kernel": "nsight", "model": m.name, **row}, default=str))


def nsight_records() -> list[dict]:
    """Runs --nsight-only in a subprocess and returns its records (or one record with its error)."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--nsight-only"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return [{"kernel": "nsight", "error": "timed out after 300 s"}]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return rows or [{"kernel": "nsight", "error": f"rc={proc.returncode}: {proc.stderr[-500:]}"}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="small shapes on the CPU (the default)")
    mode.add_argument("--gpu", action="store_true", help="Wan-1.3B and Wan-14B shapes in bf16 on CUDA")
    mode.add_argument("--nsight-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--triton-interpret", action="store_true",
                        help="--cpu: also run the Triton kernels (TRITON_INTERPRET=1)")
    parser.add_argument("--no-nsight", action="store_true", help="--gpu: skip Nsight Compute metrics")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    if args.nsight_only:
        return profile_with_nsight()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; run with --cpu (the default) for the small-shape mode")
    if args.triton_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the Triton kernels are defined (lazily imported below)
    from fvgraph.kernels._triton import triton_available

    device = torch.device("cuda" if args.gpu else "cpu")
    triton_ok = triton_available() and (args.gpu or args.triton_interpret)
    models, tokens_list = (GPU_MODELS, GPU_TOKENS) if args.gpu else (CPU_MODELS, CPU_TOKENS)
    dtype = torch.bfloat16 if args.gpu else torch.float32  # the interpreter runs fp16/fp32 only
    out = open(args.out, "a") if args.out else None

    head = provenance("kernels", device)

    def emit(rec: dict) -> None:
        line = json.dumps({**head, **rec})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    torch.manual_seed(0)
    for m in models:
        for tokens in tokens_list:
            for build in (linear_cases, elementwise_cases, attention_cases):
                for case in build(m, tokens, dtype, device, triton_ok):
                    for rec in run_case(case, m.name, device, repeats=5):
                        emit(rec)
                if args.gpu:
                    torch.cuda.empty_cache()
    skip = nsight_skip_reason(args)
    for rec in [{"kernel": "nsight", "skipped": skip}] if skip else nsight_records():
        emit(rec)
    if out:
        out.close()


if __name__ == "__main__":
    main()
