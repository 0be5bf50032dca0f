"""One adapted linear, per formulation of the slot path, interleaved (fvgraph.perf.method): what picks
SlotLinear's formulation (docs/adapters.md).

    python perf/bench_lora_linear.py --compile --thread-time   # wan-cpu-bench's linears, inductor, as a -O1 step runs them

Shapes: 512 -> 512 and 512 -> 1536 at ranks 32 and 128, 8 rows of 192 tokens (a bucket of 4
requests x 2 CFG branches), 4 slots and 2 places per row, every adapter row choosing slot 0 (slot
biases zero, as most files have). Cases per shape:

    base            the linear alone (what a batch with no adapter row runs)
    slot_k1         SlotLinear's formulation as it ships, width 1 (`add_gathered`): bmm, bmm, then
                    y + (low + slot biases)
    slot_k2         the same at width 2 (the second place unused, scale 0)
    slot_k1_m1      the rows-first formulation as it ships (`add_gathered_first`, m = 1 of 4): the first request's
                    low-rank work alone, gathered once for its two branches, its rows written back into
                    y by slice_scatter (a batch of 4, one adapter row)
    ones_baddbmm_k1 the formulation before: the slot biases as one more row of the up factors (a
                    column of ones on the low-rank activations), baddbmm onto the base output
    cat_m1          the rows-first formulation before: the m requests' rows joined to the others' by cat
    dense_slots     every slot for every row: x @ [S*R, in]^T, each row's per-slot weights, @ [S*R, out]
                    (no gather; S*R wide)

Every case's slot factors are gathered once beforehand (the rows' slots, scales folded into the
down factors), as a -O1 step hoists that gather out of the step. With `--compile`, each case is
compiled by inductor first (what a -O1 step runs); without it, eager. Prints one JSON line: ms per call (min /
median / max) per case, and per round each case / base. With `--thread-time`, torch runs on one
thread and a sample is the thread's CPU time over 20 calls (time.thread_time), not wall time: on a
CPU other jobs share, what a formulation costs, without the waits for a core that dominate wall time there.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from fvgraph.adapters.slots import LoraSlots, add_gathered, add_gathered_first, gathered, install_slots
from fvgraph.perf.method import Case, emit, interleaved, paired_ratio, provenance, spread

SLOTS, PLACES = 4, 2


def slot_factors(linear: nn.Linear, dim: int, out: int, rank: int, g: torch.Generator):
    """The slots SlotLinear reads for `linear`, random factors in every slot."""
    store = install_slots(nn.Sequential(linear), LoraSlots(SLOTS, rank, PLACES))
    t = store.target("0")
    with torch.no_grad():
        t.down.copy_(torch.randn(SLOTS, rank, dim, generator=g) * 0.02)
        t.up.copy_(torch.randn(SLOTS, rank, out, generator=g) * 0.02)
        t.scaling.fill_(1.0)
    return t


def ones_baddbmm(x, w, b, down, up, bias):
    """The formulation before: the biases as one more row of the up factors, baddbmm onto y."""
    rows = down.shape[0]
    h = torch.bmm(x.reshape(rows, -1, x.shape[-1]), down.transpose(1, 2))
    h = torch.cat([h, h.new_ones(*h.shape[:-1], 1)], dim=-1)
    return torch.baddbmm(F.linear(x, w, b).reshape(rows, -1, w.shape[0]), h, torch.cat([up, bias], dim=1))


def cat_first(x, w, b, down, up, bias, branches, bucket):
    """The rows-first formulation before: the m requests' rows joined to the others' by cat."""
    m = down.shape[0]
    y = F.linear(x, w, b)
    xs, ys = x.reshape(branches, bucket, -1, x.shape[-1]), y.reshape(branches, bucket, -1, y.shape[-1])
    xm = xs[:, :m].transpose(0, 1).reshape(m, -1, x.shape[-1])
    low = torch.bmm(torch.bmm(xm, down.transpose(1, 2)), up) + bias
    top = ys[:, :m] + low.view(m, branches, ys.shape[2], -1).transpose(0, 1)
    return torch.cat([top, ys[:, m:]], dim=1).reshape(y.shape)


def dense(x, w, b, down, up, weights):
    """Every slot for every row, each row's per-slot weights [N, S] on the activations."""
    rows, rank = weights.shape[0], down.shape[1]
    h = F.linear(x, down.flatten(0, 1)).reshape(rows, -1, down.shape[0] * rank)
    h = h * weights.repeat_interleave(rank, dim=1).unsqueeze(1)
    return torch.addmm(F.linear(x, w, b).reshape(-1, w.shape[0]), h.reshape(-1, h.shape[-1]), up.flatten(0, 1)).reshape(rows, -1, w.shape[0])


def cases(rows: int, tokens: int, dim: int, out: int, rank: int, compile_: bool) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, tokens, dim, generator=g)
    linear = nn.Linear(dim, out)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, dim, generator=g) / dim**0.5)
        linear.bias.zero_()
    w, b = linear.weight.detach().clone(), linear.bias.detach().clone()
    t = slot_factors(linear, dim, out, rank, g)
    index = torch.zeros(rows, PLACES, dtype=torch.long)
    scale = torch.zeros(rows, PLACES)
    scale[:, 0] = 1.0
    one = scale.clone()
    one[1 : rows // 2] = 0.0  # the first request of each branch uses the adapter
    one[rows // 2 + 1 :] = 0.0
    bucket = rows // 2
    # The gathers, once: a -O1 step hoists them out of the step (they depend on request constants only).
    k1, k2 = gathered(t, index[:, :1], scale[:, :1], x.dtype), gathered(t, index, scale, x.dtype)
    m1 = [f[:1] for f in gathered(t, index[:bucket, :1], one[:bucket, :1], x.dtype)]
    weights = torch.zeros(rows, SLOTS).scatter_add_(1, index, scale * t.scaling[index])
    forms = {"base": lambda: F.linear(x, w, b),
             "slot_k1": lambda: add_gathered(F.linear(x, w, b), x, *k1),
             "slot_k2": lambda: add_gathered(F.linear(x, w, b), x, *k2),
             "slot_k1_m1": lambda: add_gathered_first(F.linear(x, w, b), x, *m1, branches=2, bucket=bucket),
             "ones_baddbmm_k1": lambda: ones_baddbmm(x, w, b, *k1),
             "cat_m1": lambda: cat_first(x, w, b, *m1, 2, bucket),
             "dense_slots": lambda: dense(x, w, b, t.down, t.up, weights)}  # fmt: skip
    if compile_:
        forms = {name: torch.compile(run, backend="inductor", dynamic=False) for name, run in forms.items()}
    return [Case(f"{name}_o{out}_r{rank}", run) for name, run in forms.items()]


def thread_seconds(run, device) -> float:
    """Seconds of this thread's CPU time per call, over 20 calls."""
    began = time.thread_time()
    for _ in range(20):
        run()
    return (time.thread_time() - began) / 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="batch rows (requests x CFG branches)")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--thread-time", action="store_true", help="one torch thread; thread CPU time per sample")
    parser.add_argument("--compile", action="store_true", help="each case compiled by inductor first, as a -O1 step")
    args = parser.parse_args(argv)
    measure = {}
    if args.thread_time:
        torch.set_num_threads(1)
        measure["measure"] = thread_seconds
    shapes = [(out, rank) for out in (512, 1536) for rank in (32, 128)]
    all_cases = [c for out, rank in shapes for c in cases(args.rows, args.tokens, 512, out, rank, args.compile)]
    with torch.no_grad():
        samples, _ = interleaved(all_cases, args.repeats, 3, torch.device("cpu"), **measure)
    ratios = {name: paired_ratio(s, samples["base_o" + name.rsplit("_o", 1)[1]])  # each against the base of its shape
              for name, s in samples.items() if not name.startswith("base_")}  # fmt: skip
    emit({**provenance("lora_linear", torch.device("cpu")), "rows": args.rows, "tokens": args.tokens, "in_features": 512,
          "slots": SLOTS, "places": PLACES, "clock": "thread_time, 1 thread" if args.thread_time else "wall", "compiled": args.compile, "per_call_ms": {n: spread(s, 1e3) for n, s in samples.items()},
          "time_ratio_per_round": ratios})  # fmt: skip


if __name__ == "__main__":
    main()
