"""The fixed tail of every pipeline: drop fvgraph's marker ops and dead code before inductor.

Markers are identity ops that exist only for the passes to key on; left in, each would be a copy.

Before:  e = request_constant(prompt_embeds); y = linear(e, w)
After:   y = linear(prompt_embeds, w)
"""

from __future__ import annotations

from torch import fx

from fvgraph.contract.markers import MARKER_OPS
from fvgraph.passes.base import FxPass, PassContext, eliminate_dead_code


class CleanupPass(FxPass):
    name = "cleanup"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        removed = 0
        packets = {op.overloadpacket for op in MARKER_OPS}
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and (node.target in MARKER_OPS or node.target in packets):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                removed += 1
        eliminate_dead_code(gm.graph)
        ctx.changed[self.name] = removed
        return gm
