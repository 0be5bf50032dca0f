"""Tap outputs: each `fvgraph::tap` marker becomes an extra output of the step graph (parity runs only).

Before:  y = tap(block_out, "tap.block.3.0"); z = next_block(y);  return (latents, ...)
After:   z = next_block(block_out);                               return (latents, ..., block_out)

The names, in graph order, go to `ctx.extra_outputs` so the compiled step can label them. A traced
block that ran on the fused CFG batch carries both branches in one tap.
"""

from __future__ import annotations

import torch
from torch import fx

from fvgraph.passes.base import FxPass, PassContext, marker_nodes


class TapOutputsPass(FxPass):
    name = "tap_outputs"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        taps = marker_nodes(gm.graph, torch.ops.fvgraph.tap)
        if not taps:
            return gm
        output = next(n for n in gm.graph.nodes if n.op == "output")
        values = list(output.args[0])
        for node in taps:
            source, name = node.args
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            values.append(source)
            ctx.extra_outputs.append(name)
        output.args = (tuple(values),)
        ctx.changed[self.name] = len(taps)
        return gm
