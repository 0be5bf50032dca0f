"""The parallel plans on paper: bytes each GPU sends per denoise step and the step time that implies.

    python perf/parallel_plan.py              # one JSON object: the assumptions and one row per model x shape x plan
    python perf/parallel_plan.py --markdown   # the same rows as the table in docs/parallel.md

Nothing here runs a model: it is arithmetic on the released Wan 2.1 transformer configs (cards/wan.py)
and stated hardware figures, so a reader can check every number by hand.

Shapes. The Wan VAE compresses 4 frames (after the first) and 8x8 pixels into one latent; the
transformer patches 1x2x2 latents into one token: S = (1 + (frames - 1) / 4) * (H / 16) * (W / 16).

A step is the whole CFG step: the cond and uncond forwards (batch 2 on one rank; one branch each under
CFG-parallel) and the guidance combine. Plans, for degrees C (CFG) and U (Ulysses), on C * U GPUs:
- Ulysses U: every rank holds S/U tokens of every head outside self-attention; around each
  self-attention four all-to-alls (Q, K and V before it, the output after it) trade that for all S
  tokens of H/U heads. Each moves b * (S/U) * D bf16 values per rank, of which (U-1)/U leave the
  rank. Cross-attention needs none (its text K/V are whole on every rank), nor do the norms, FFN and
  modulation (per token). At the end each rank's S/U rows of the prediction (out_channels * 1*2*2
  values per token) are all-gathered.
- CFG-parallel 2: each rank runs one branch at batch 1; the partner ranks exchange their predictions
  (S/U * 64 values) for the guidance combine.
Compute per step is FLOPs / rate at the H200 rates measured in docs (DESIGN: bf16 matmul 754
TFLOP/s, cuDNN SDPA 595 TFLOP/s); each rank does 1/(C*U) of the linears and of the attention. The
cross-attention's text K/V projections are request-constant (fvgraph hoists them out of the step), so
they are not in the step. Communication is not overlapped with compute (Ulysses' all-to-alls sit on
the attention's critical path), so the expected step time is compute / (C*U) + communication.
"""

from __future__ import annotations

import argparse
import json

from fvgraph.cards.wan import WAN_1_3B_TRANSFORMER, WAN_14B_TRANSFORMER

VAE_TEMPORAL, VAE_SPATIAL = 4, 8  # Wan VAE: 4 frames (after the first) and 8x8 pixels per latent
TEXT_TOKENS = 512  # WanPipeline's max_sequence_length: the UMT5 prompt embeddings cross-attention reads
BF16_BYTES = 2
# Measured outside the project on an H200 (torch 2.11.0+cu130, bf16, standalone probe scripts, 2026-11-29):
MATMUL_FLOPS = 754e12  # an 8192^3 bf16 matmul
SDPA_FLOPS = 595e12  # cuDNN SDPA at 14040 tokens, 12 heads x 128
# NVLink 4 on H200 SXM: 900 GB/s per GPU, both directions together (NVIDIA's H200 specifications),
# so 450 GB/s leave a GPU; through the NVSwitch of an 8-GPU board every pair gets it.
NVLINK_BYTES_PER_S_ONE_WAY = 450e9
MODELS = {"wan2.1-1.3b": WAN_1_3B_TRANSFORMER, "wan2.1-14b": WAN_14B_TRANSFORMER}
SHAPES = {"480p": (81, 480, 832), "720p": (81, 720, 1280)}
PLANS = [(1, 1), (2, 1), (1, 2), (1, 4), (1, 8), (2, 4)]  # (CFG degree, Ulysses degree)


def tokens(frames: int, height: int, width: int, patch: tuple[int, int, int]) -> int:
    latent = (1 + (frames - 1) // VAE_TEMPORAL, height // VAE_SPATIAL, width // VAE_SPATIAL)
    return (latent[0] // patch[0]) * (latent[1] // patch[1]) * (latent[2] // patch[2])


def step_flops(config: dict, seq: int) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of one CFG step: two forwards, per layer self-attention q/k/v/o,
    cross-attention q/o, the FFN, and the two attentions' score and value products."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    per_layer_linear = 2 * seq * dim * dim * 4 + 2 * seq * dim * dim * 2 + 2 * seq * dim * config["ffn_dim"] * 2
    per_layer_attention = 4 * seq * seq * dim + 4 * seq * TEXT_TOKENS * dim
    return 2 * config["num_layers"] * per_layer_linear, 2 * config["num_layers"] * per_layer_attention


def plan_row(model: str, shape: str, cfg: int, ulysses: int, link_fractions: list[float], latency_s: float) -> dict:
    config = MODELS[model]
    heads, layers = config["num_attention_heads"], config["num_layers"]
    dim = heads * config["attention_head_dim"]
    frames, height, width = SHAPES[shape]
    seq = tokens(frames, height, width, config["patch_size"])
    row = {"model": model, "shape": f"{frames}x{height}x{width}", "cfg": cfg, "ulysses": ulysses, "gpus": cfg * ulysses,
           "tokens": seq, "hidden": dim, "heads": heads, "layers": layers}  # fmt: skip
    if heads % ulysses:
        return {**row, "valid": False, "why": f"Ulysses {ulysses} does not divide {heads} heads"}
    batch = 2 // cfg  # rows each rank runs: both branches, or its one
    shard = -(-seq // ulysses)  # tokens per rank (the last rank pads)
    out_values = config["out_channels"] * config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2]
    all_to_all = batch * shard * dim * BF16_BYTES * (ulysses - 1) / ulysses  # bytes leaving a rank, one all-to-all
    all_to_alls = 4 * layers if ulysses > 1 else 0
    gather = batch * shard * out_values * BF16_BYTES * (ulysses - 1)  # the prediction's rows to the other ranks
    cfg_exchange = shard * out_values * BF16_BYTES if cfg > 1 else 0
    collectives = all_to_alls + (ulysses > 1) + (cfg > 1)
    step_bytes = all_to_all * all_to_alls + gather + cfg_exchange
    linear, attention = step_flops(config, seq)
    compute_1 = linear / MATMUL_FLOPS + attention / SDPA_FLOPS
    compute = compute_1 / (cfg * ulysses)
    row.update(
        valid=True, tokens_per_rank=shard, heads_per_rank=heads // ulysses, rows_per_rank=batch,
        all_to_all_bytes=round(all_to_all), all_to_alls_per_step=all_to_alls, gather_bytes=round(gather),
        cfg_exchange_bytes=cfg_exchange, step_bytes_per_gpu=round(step_bytes), step_tflop=round((linear + attention) / 1e12, 1),
        compute_s_1gpu=round(compute_1, 4), compute_s_per_gpu=round(compute, 4),
    )  # fmt: skip
    for fraction in link_fractions:
        comm = step_bytes / (NVLINK_BYTES_PER_S_ONE_WAY * fraction) + collectives * latency_s
        row[f"comm_s@{fraction:g}"] = round(comm, 4)
        row[f"speedup@{fraction:g}"] = round(compute_1 / (compute + comm), 2)
    return row


def rows(link_fractions: list[float], latency_s: float) -> list[dict]:
    return [plan_row(model, shape, cfg, ulysses, link_fractions, latency_s)
            for model in MODELS for shape in SHAPES for cfg, ulysses in PLANS]  # fmt: skip


def markdown(table: list[dict], link_fractions: list[float]) -> str:
    head = ["model", "shape", "tokens", "plan", "GPUs", "one all-to-all (MB)", "per step (MB/GPU)", "compute 1 GPU (s)",
            *(f"comm at {f:g} of peak (ms)" for f in link_fractions), *(f"speedup at {f:g}" for f in link_fractions)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in table:
        plan = " x ".join(part for part in (f"CFG {row['cfg']}" if row["cfg"] > 1 else "",
                                            f"Ulysses {row['ulysses']}" if row["ulysses"] > 1 else "") if part) or "1 GPU"  # fmt: skip
        if not row["valid"]:
            lines.append(f"| {row['model']} | {row['shape']} | {row['tokens']} | {plan} | {row['gpus']} | "
                         + " | ".join([row["why"]] + [""] * (len(head) - 6)) + " |")  # fmt: skip
            continue
        cells = [row["model"], row["shape"], row["tokens"], plan, row["gpus"],
                 f"{row['all_to_all_bytes'] / 1e6:.1f}" if row["all_to_alls_per_step"] else "-",
                 f"{row['step_bytes_per_gpu'] / 1e6:.0f}", f"{row['compute_s_1gpu']:.2f}",
                 *(f"{row[f'comm_s@{f:g}'] * 1e3:.0f}" for f in link_fractions),
                 *(f"{row[f'speedup@{f:g}']:.2f}" for f in link_fractions)]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--link-fractions", default="1,0.25", help="Fractions of NVLink's peak the collectives reach (comma separated).")
    parser.add_argument("--collective-latency-us", type=float, default=25.0, help="Fixed cost of one collective, microseconds (an assumption).")
    parser.add_argument("--markdown", action="store_true", help="Print the table in docs/parallel.md instead of JSON.")
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.link_fractions.split(",")]
    if not all(0 < f <= 1 for f in fractions):
        parser.error(f"--link-fractions={args.link_fractions!r}: each must be in (0, 1]")
    table = rows(fractions, args.collective_latency_us * 1e-6)
    if args.markdown:
        print(markdown(table, fractions))
        return
    assumptions = {"vae": f"{VAE_TEMPORAL}x temporal, {VAE_SPATIAL}x{VAE_SPATIAL} spatial", "patch": "1x2x2",
                   "text_tokens": TEXT_TOKENS, "dtype": "bf16", "matmul_flops": MATMUL_FLOPS, "sdpa_flops": SDPA_FLOPS,
                   "nvlink_bytes_per_s_one_way": NVLINK_BYTES_PER_S_ONE_WAY,
                   "collective_latency_s": args.collective_latency_us * 1e-6, "overlap": "none"}  # fmt: skip
    print(json.dumps({"assumptions": assumptions, "rows": table}))


if __name__ == "__main__":
    main()
