"""Finite flags: the step graph also returns, per request, whether the outputs it computed are finite.

A request whose step produced NaN or Inf must fail, alone (fvgraph/engine/fold_back.py). Reduced
inside the graph, the check is one fused reduction per output on the device (inside the CUDA graph
when there is one), and the host reads one [batch] bool tensor per batch instead of launching a
handful of eager ops per output.

Before:  return (latents, history)
After:   return (latents, history, finite)

`finite[i]` is True when every row of request i (row i, or rows i, batch + i, ... of a branch-major
fused-CFG output) of every output is finite. Outputs that are step inputs passed through are not
checked: the step did not produce them. Runs last, on the step graph only (the prologue's outputs
are the step's inputs), and names its output FINITE_OUTPUT in `ctx.extra_outputs`.
"""

from __future__ import annotations

import torch
from torch import fx

from fvgraph.passes.base import FxPass, PassContext

FINITE_OUTPUT = "finite"


class FiniteFlagsPass(FxPass):
    name = "finite_flags"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        inputs = set(placeholders[ctx.num_params : len(ctx.example_args)])  # the step inputs (not weights, not hoisted)
        output = next(n for n in graph.nodes if n.op == "output")
        values = list(output.args[0])
        computed = [v for v in values if isinstance(v, fx.Node) and v not in inputs]
        if not computed:
            return gm  # nothing computed to check: the runner treats every row as finite
        flags = None
        with graph.inserting_before(output):
            for value in computed:
                rows = graph.call_method("size", (value, 0))
                finite = graph.call_method("reshape", (graph.call_function(torch.isfinite, (value,)), rows, -1))
                per_row = graph.call_method("all", (finite, 1))  # [rows], rows = m * batch, branch-major
                per_request = graph.call_method("all", (graph.call_method("reshape", (per_row, -1, ctx.batch)), 0))
                flags = per_request if flags is None else graph.call_function(torch.logical_and, (flags, per_request))
        output.args = ((*values, flags),)
        ctx.extra_outputs.append(FINITE_OUTPUT)
        ctx.changed[self.name] = len(computed)
        return gm
