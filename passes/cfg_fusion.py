"""CFG-branch fusion: run the denoiser once on the concatenated cond + uncond batch.

A CFG step calls the denoiser twice with the same latents and timestep and different text. Traced,
that is two inlined copies of every block; fused, it is one copy at twice the batch, which halves the
weight traffic and the launches and gives the GEMMs a taller M.

Before (markers from fvgraph.contract.markers around each call):

    x_c = branch_input(x, "cond", "transformer", "hidden_states")      ... e_c = branch_input(pe, ...)
    <blocks ... on x_c, t_c, e_c>           # copy 1
    out_c = branch_output(y_c, "cond", "transformer")
    x_u = branch_input(x, "uncond", ...)    ... e_u = branch_input(ne, ...)
    <blocks ... on x_u, t_u, e_u>           # copy 2
    out_u = branch_output(y_u, "uncond", "transformer")

A call whose result has several tensors marks each with its index (`branch_output(y, ..., index)`);
each is split back per branch. After (then re-traced, so the blocks are inlined once again, at batch 2B):

    y = transformer(hidden_states=cat([x, x]), timestep=cat([t, t]),
                    encoder_hidden_states=cat([pe, ne]), return_dict=False)[0]
    out_c, out_u = chunk(y, 2)

The fused call is re-traced with dynamo rather than patched in place: the inlined copies carry their
batch size baked into every view and reshape, and a fresh trace is the one way to get them all right.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from fvgraph.contract.markers import branch_input, branch_output
from fvgraph.passes.base import FxPass, PassContext, eliminate_dead_code, export_graph, marker_nodes

log = logging.getLogger(__name__)

FUSED_PREFIX = "fvgraph_cfg_fused_"


class CfgFusionPass(FxPass):
    name = "cfg_fusion"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        branches = _collect_branches(gm.graph)
        if set(branches) != {"cond", "uncond"}:
            return gm  # nothing to fuse (a guidance-free step has one branch)
        cond, uncond = branches["cond"], branches["uncond"]
        if (cond["module"] != uncond["module"] or set(cond["inputs"]) != set(uncond["inputs"])
                or set(cond["outputs"]) != set(uncond["outputs"])):  # fmt: skip
            log.warning("cfg_fusion: branches call different modules, arguments or outputs; left unfused")
            return gm
        anchor = _insertion_point(gm.graph, cond, uncond)
        if anchor is None:
            log.warning("cfg_fusion: a branch output is used before the other branch's inputs exist; left unfused")
            return gm

        target = FUSED_PREFIX + cond["module"].replace(".", "_")
        gm.add_submodule(target, ctx.root.get_submodule(cond["module"]))
        graph = gm.graph
        with graph.inserting_before(anchor):
            kwargs = {
                arg: graph.call_function(torch.cat, ([cond["inputs"][arg], uncond["inputs"][arg]],), {"dim": 0})
                for arg in cond["inputs"]
            }
            fused = graph.call_module(target, (), {**kwargs, "return_dict": False})
            halves = {}
            for index in cond["outputs"]:  # each marked element of the call's result, split back per branch
                element = graph.call_function(operator.getitem, (fused, index))
                chunks = graph.call_function(torch.chunk, (element, 2), {"dim": 0})
                halves[index] = [graph.call_function(operator.getitem, (chunks, half)) for half in (0, 1)]
        for index, (cond_out, uncond_out) in halves.items():
            cond["outputs"][index].replace_all_uses_with(cond_out)
            uncond["outputs"][index].replace_all_uses_with(uncond_out)
        ctx.changed[self.name] = eliminate_dead_code(graph)
        gm.recompile()
        return _retrace(gm, ctx)


def _collect_branches(graph: fx.Graph) -> dict[str, dict]:
    """{branch: {"module": path, "inputs": {arg: source node}, "outputs": {index: marker node}}}: a
    call may return several tensors (a cached step's prediction and blocks' residual), each marked."""
    branches: dict[str, dict] = {}
    for node in marker_nodes(graph, torch.ops.fvgraph.branch_input):
        source, branch, module, arg = node.args
        entry = branches.setdefault(branch, {"module": module, "inputs": {}, "outputs": {}, "markers": []})
        entry["inputs"][arg] = source
        entry["markers"].append(node)
    for node in marker_nodes(graph, torch.ops.fvgraph.branch_output):
        branch = node.args[1]
        index = node.args[3] if len(node.args) > 3 else node.kwargs.get("index", 0)
        if branch in branches:
            branches[branch]["outputs"][index] = node
    return {name: entry for name, entry in branches.items() if entry["outputs"]}


def _insertion_point(graph: fx.Graph, cond: dict, uncond: dict) -> fx.Node | None:
    """The first user of either branch's output, provided every branch input is defined before it."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    users = [user for b in (cond, uncond) for output in b["outputs"].values() for user in output.users]
    first_user = min(users, key=order.__getitem__)
    last_input = max(order[src] for b in (cond, uncond) for src in b["inputs"].values())
    return first_user if last_input < order[first_user] else None


def _retrace(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Inline the fused module call again with dynamo (same calling convention as before)."""
    return export_graph(gm, ctx.example_args)


# Referenced so the uuid changes if the marker schema does.
_MARKERS = (branch_input, branch_output)
