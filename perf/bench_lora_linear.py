"""One adapted linear, per formulation of the slot path, interleaved (fvgraph.perf.method): what picks
SlotLinear's formulation (docs/adapters.md).

    python perf/bench_lora_linear.py     # wan-cpu-bench's linears: 512 -> 512 and 512 -> 1536, 8 rows of 192 tokens

Cases per (out features, rank R), with 4 slots and 2 places per row, every row choosing slot 0:

    base            the linear alone (what a batch with no adapter row runs)
    gather_k1       SlotLinear at width 1: the rows' slots gathered, scales folded into the down
                    factors, bmm then baddbmm (a batch whose rows use one adapter each)
    gather_k2       the same at width 2 (the second place unused, scale 0)
    gather_k1_m1    gather_k1 with the adapter rows first and the low-rank work on the first row of
                    each branch only (a batch of 4 with one adapter row: SlotLinear under rows_first)
    gather_k1_hscale  gather_k1 with the scales applied to the low-rank activations instead of the
                    down factors (no per-row scaled copy of the factors)
    gather_k1_nobias  gather_k1 without the slot bias term (y + bias is an output-sized pass before
                    the baddbmm; it shows what that pass costs)
    dense_slots     every slot for every row: x @ [S*R, in]^T, each row's per-slot weights, @ [S*R, out]
                    (no gather; S*R wide)
    where_k2        the formulation before: gather, `where` masks on the activations, bmm, add

Prints one JSON line: ms per call (min / median / max) per case, and per round each case / base.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from fvgraph.perf.method import Case, emit, interleaved, paired_ratio, provenance, spread

SLOTS, PLACES = 4, 2


def gather(x, w, b, down, up, scaling, index, scale, y=None):
    rows = index.shape[0]
    s = torch.where(scale != 0, scale * scaling[index], 0.0)
    d = (down[index] * s[:, :, None, None]).flatten(1, 2)
    bias = (s.unsqueeze(-1) * torch.zeros(down.shape[0], w.shape[0])[index]).sum(1, keepdim=True)  # the slots' (zero) biases
    y = (F.linear(x, w, b) if y is None else y).reshape(rows, -1, w.shape[0])
    return torch.baddbmm(y + bias, torch.bmm(x.reshape(rows, -1, x.shape[-1]), d.transpose(1, 2)), up[index].flatten(1, 2))


def gather_nobias(x, w, b, down, up, scaling, index, scale):
    rows = index.shape[0]
    s = torch.where(scale != 0, scale * scaling[index], 0.0)
    d = (down[index] * s[:, :, None, None]).flatten(1, 2)
    y = F.linear(x, w, b).reshape(rows, -1, w.shape[0])
    return torch.baddbmm(y, torch.bmm(x.reshape(rows, -1, x.shape[-1]), d.transpose(1, 2)), up[index].flatten(1, 2))


def gather_first(x, w, b, down, up, scaling, index, scale, m, bucket):
    """SlotLinear under rows_first: each of the first m requests' slots gathered once for its branches
    (rows are [branch, bucket]), its branches' tokens through one GEMM; the other rows the base alone."""
    branches = index.shape[0] // bucket
    s = torch.where(scale[:bucket] != 0, scale[:bucket] * scaling[index[:bucket]], 0.0)
    d = (down[index[:bucket]] * s[:, :, None, None]).flatten(1, 2)[:m]
    u = up[index[:bucket]].flatten(1, 2)[:m]
    bias = (s.unsqueeze(-1) * torch.zeros(down.shape[0], w.shape[0])[index[:bucket]]).sum(1, keepdim=True)[:m]
    y = F.linear(x, w, b).reshape(branches, bucket, -1, w.shape[0])
    xs = x.reshape(branches, bucket, -1, x.shape[-1])
    tokens = y.shape[2]
    xm = xs[:, :m].transpose(0, 1).reshape(m, branches * tokens, -1)
    low = torch.baddbmm(bias, torch.bmm(xm, d.transpose(1, 2)), u)
    top = y[:, :m] + low.view(m, branches, tokens, -1).transpose(0, 1)
    return torch.cat([top, y[:, m:]], dim=1)


def gather_hscale(x, w, b, down, up, scaling, index, scale):
    rows = index.shape[0]
    s = torch.where(scale != 0, scale * scaling[index], 0.0)
    h = torch.bmm(x.reshape(rows, -1, x.shape[-1]), down[index].flatten(1, 2).transpose(1, 2))
    h = h * s.repeat_interleave(down.shape[1], dim=1).unsqueeze(1)
    return torch.baddbmm(F.linear(x, w, b).reshape(rows, -1, w.shape[0]), h, up[index].flatten(1, 2))


def dense(x, w, b, down, up, scaling, index, scale):
    rows, rank = index.shape[0], down.shape[1]
    weights = torch.zeros(rows, down.shape[0]).scatter_add_(1, index, scale * scaling[index])  # [N, S]
    h = F.linear(x, down.flatten(0, 1)).reshape(rows, -1, down.shape[0] * rank)
    h = h * weights.repeat_interleave(rank, dim=1).unsqueeze(1)
    return torch.addmm(F.linear(x, w, b).reshape(-1, w.shape[0]), h.reshape(-1, h.shape[-1]), up.flatten(0, 1)).reshape(rows, -1, w.shape[0])


def where(x, w, b, down, up, scaling, index, scale):
    rows, rank = index.shape[0], down.shape[1]
    y = F.linear(x, w, b)
    used = scale != 0
    s = torch.where(used, scale * scaling[index], 0.0)
    used_rank = used.repeat_interleave(rank, dim=1)
    x3 = x.reshape(rows, -1, x.shape[-1])
    d = down[index].flatten(1, 2)
    u = torch.where(used_rank.unsqueeze(-1), up[index].flatten(1, 2), 0.0)
    h = torch.where(used_rank.unsqueeze(1), torch.bmm(x3, d.transpose(1, 2)) * s.repeat_interleave(rank, dim=1).unsqueeze(1), 0.0)
    return y + torch.bmm(h, u).reshape(y.shape)


def cases(rows: int, tokens: int, dim: int, out: int, rank: int) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, tokens, dim, generator=g)
    w, b = torch.randn(out, dim, generator=g) / dim**0.5, torch.zeros(out)
    down, up = torch.randn(SLOTS, rank, dim, generator=g) * 0.02, torch.randn(SLOTS, rank, out, generator=g) * 0.02
    scaling = torch.ones(SLOTS)
    index = torch.zeros(rows, PLACES, dtype=torch.long)
    scale = torch.zeros(rows, PLACES)
    scale[:, 0] = 1.0
    tag = f"o{out}_r{rank}"
    return [Case(f"base_{tag}", lambda: F.linear(x, w, b)),
            Case(f"gather_k1_{tag}", lambda: gather(x, w, b, down, up, scaling, index[:, :1], scale[:, :1])),
            Case(f"gather_k2_{tag}", lambda: gather(x, w, b, down, up, scaling, index, scale)),
            Case(f"gather_k1_m1_{tag}", lambda: gather_first(x, w, b, down, up, scaling, index[:, :1], scale[:, :1], 1, rows // 2)),
            Case(f"gather_k1_nobias_{tag}", lambda: gather_nobias(x, w, b, down, up, scaling, index[:, :1], scale[:, :1])),
            Case(f"gather_k1_hscale_{tag}", lambda: gather_hscale(x, w, b, down, up, scaling, index[:, :1], scale[:, :1])),
            Case(f"dense_slots_{tag}", lambda: dense(x, w, b, down, up, scaling, index, scale)),
            Case(f"where_k2_{tag}", lambda: where(x, w, b, down, up, scaling, index, scale))]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="batch rows (requests x CFG branches)")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    shapes = [(out, rank) for out in (512, 1536) for rank in (32, 128)]
    all_cases = [c for out, rank in shapes for c in cases(args.rows, args.tokens, 512, out, rank)]
    with torch.no_grad():
        samples, _ = interleaved(all_cases, args.repeats, 3, torch.device("cpu"))
    ratios = {name: paired_ratio(s, samples["base_o" + name.rsplit("_o", 1)[1]])  # each against the base of its shape
              for name, s in samples.items() if not name.startswith("base_")}  # fmt: skip
    emit({**provenance("lora_linear", torch.device("cpu")), "rows": args.rows, "tokens": args.tokens, "in_features": 512,
          "slots": SLOTS, "places": PLACES, "per_call_ms": {n: spread(s, 1e3) for n, s in samples.items()},
          "time_ratio_per_round": ratios})  # fmt: skip


if __name__ == "__main__":
    main()
