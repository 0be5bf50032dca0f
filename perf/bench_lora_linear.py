"""One adapted linear, per formulation of the slot path, interleaved (fvgraph.perf.method): what picks
SlotLinear's formulation (docs/adapters.md).

    python perf/bench_lora_linear.py     # wan-cpu-bench's linears: 512 -> 512 and 512 -> 1536, 8 rows of 192 tokens

Cases per (out features, rank R), with 4 slots and 2 places per row, 8 rows = a bucket of 4
requests x 2 CFG branches, every row choosing slot 0 (slot biases zero, as most files have):

    base            the linear alone (what a batch with no adapter row runs)
    slot_k1         SlotLinear as it ships, width 1: the rows' slots gathered, scales folded into the
                    down factors, the slot biases as one more row of the up factors (a column of
                    ones on the low-rank activations), bmm then baddbmm onto the base output
    slot_k2         the same at width 2 (the second place unused, scale 0)
    slot_k1_m1      SlotLinear under `rows_first(1, 4)`: the low-rank work of the first request alone,
                    gathered once for its two branches, its rows joined to the others' base output (a
                    batch of 4, one adapter row)
    bias_pass_k1    the formulation before: as slot_k1 but the biases added to the base output in
                    an output-sized pass of their own before the baddbmm
    scaled_h_k1     as bias_pass_k1 without biases, the scales applied to the low-rank activations
                    instead of the down factors
    dense_slots     every slot for every row: x @ [S*R, in]^T, each row's per-slot weights, @ [S*R, out]
                    (no gather; S*R wide)
    where_k2        the formulation before those: gather, `where` masks on the activations, bmm, add

Prints one JSON line: ms per call (min / median / max) per case, and per round each case / base.
With `--thread-time`, torch runs on one thread and a sample is the thread's CPU time over 5 calls
(time.thread_time), not wall time: on a CPU other jobs share, what a formulation costs, without the
waits for a core that dominate wall time there.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from fvgraph.adapters.slots import LoraSlots, SlotStore, install_slots
from fvgraph.perf.method import Case, emit, interleaved, paired_ratio, provenance, spread

SLOTS, PLACES = 4, 2


def slot_linear(linear: nn.Linear, dim: int, out: int, rank: int, g: torch.Generator) -> tuple[nn.Module, SlotStore]:
    """`linear` with SlotLinear's forward and random factors in every slot (the engine's code path)."""
    holder = nn.Sequential(linear)
    store = install_slots(holder, LoraSlots(SLOTS, rank, PLACES))
    t = store.target("0")
    with torch.no_grad():
        t.down.copy_(torch.randn(SLOTS, rank, dim, generator=g) * 0.02)
        t.up.copy_(torch.randn(SLOTS, rank, out, generator=g) * 0.02)
        t.scaling.fill_(1.0)
    return linear, store


def run_slots(linear, store, x, index, scale, first=None):
    store.choose(index, scale)
    try:
        if first is None:
            return linear(x)
        with store.rows_first(*first):
            return linear(x)
    finally:
        store.release()


def bias_pass(x, w, b, down, up, scaling, index, scale):
    rows = index.shape[0]
    s = torch.where(scale != 0, scale * scaling[index], 0.0)
    d = (down[index] * s[:, :, None, None]).flatten(1, 2)
    bias = (s.unsqueeze(-1) * torch.zeros(down.shape[0], w.shape[0])[index]).sum(1, keepdim=True)  # the slots' (zero) biases
    y = F.linear(x, w, b).reshape(rows, -1, w.shape[0])
    return torch.baddbmm(y + bias, torch.bmm(x.reshape(rows, -1, x.shape[-1]), d.transpose(1, 2)), up[index].flatten(1, 2))


def scaled_h(x, w, b, down, up, scaling, index, scale):
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
    linear = nn.Linear(dim, out)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, dim, generator=g) / dim**0.5)
        linear.bias.zero_()
    w, b = linear.weight.detach().clone(), linear.bias.detach().clone()
    slotted, store = slot_linear(linear, dim, out, rank, g)
    t = store.target("0")
    down, up, scaling = t.down, t.up, t.scaling
    index = torch.zeros(rows, PLACES, dtype=torch.long)
    scale = torch.zeros(rows, PLACES)
    scale[:, 0] = 1.0
    one = scale.clone()
    one[1 : rows // 2] = 0.0  # the first request of each branch uses the adapter
    one[rows // 2 + 1 :] = 0.0
    tag = f"o{out}_r{rank}"
    return [Case(f"base_{tag}", lambda: F.linear(x, w, b)),
            Case(f"slot_k1_{tag}", lambda: run_slots(slotted, store, x, index[:, :1], scale[:, :1])),
            Case(f"slot_k2_{tag}", lambda: run_slots(slotted, store, x, index, scale)),
            Case(f"slot_k1_m1_{tag}", lambda: run_slots(slotted, store, x, index[:, :1], one[:, :1], (1, rows // 2))),
            Case(f"bias_pass_k1_{tag}", lambda: bias_pass(x, w, b, down, up, scaling, index[:, :1], scale[:, :1])),
            Case(f"scaled_h_k1_{tag}", lambda: scaled_h(x, w, b, down, up, scaling, index[:, :1], scale[:, :1])),
            Case(f"dense_slots_{tag}", lambda: dense(x, w, b, down, up, scaling, index, scale)),
            Case(f"where_k2_{tag}", lambda: where(x, w, b, down, up, scaling, index, scale))]  # fmt: skip


def thread_seconds(run, device) -> float:
    """Seconds of this thread's CPU time per call, over 5 calls."""
    began = time.thread_time()
    for _ in range(5):
        run()
    return (time.thread_time() - began) / 5


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="batch rows (requests x CFG branches)")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--thread-time", action="store_true", help="one torch thread; thread CPU time per sample")
    args = parser.parse_args(argv)
    measure = {}
    if args.thread_time:
        torch.set_num_threads(1)
        measure["measure"] = thread_seconds
    shapes = [(out, rank) for out in (512, 1536) for rank in (32, 128)]
    all_cases = [c for out, rank in shapes for c in cases(args.rows, args.tokens, 512, out, rank)]
    with torch.no_grad():
        samples, _ = interleaved(all_cases, args.repeats, 3, torch.device("cpu"), **measure)
    ratios = {name: paired_ratio(s, samples["base_o" + name.rsplit("_o", 1)[1]])  # each against the base of its shape
              for name, s in samples.items() if not name.startswith("base_")}  # fmt: skip
    emit({**provenance("lora_linear", torch.device("cpu")), "rows": args.rows, "tokens": args.tokens, "in_features": 512,
          "slots": SLOTS, "places": PLACES, "clock": "thread_time, 1 thread" if args.thread_time else "wall", "per_call_ms": {n: spread(s, 1e3) for n, s in samples.items()},
          "time_ratio_per_round": ratios})  # fmt: skip


if __name__ == "__main__":
    main()
