"""CFG-branch fusion: run the denoiser once on the concatenated cond + uncond batch.

A CFG step calls the denoiser twice with the same latents and timestep and different text. Traced
as written, that is two inlined copies of every block; fused, it is one copy at twice the batch, which
halves the weight traffic and the launches and gives the GEMMs a taller M.

The inlined copies carry their batch size baked into every view and reshape, so the fused graph
cannot be patched out of the two copies; it is traced fused in the first place. Before the step is
traced, `tracing(step)` sets its `fuse_branches` (fvgraph/contract/cfg_branches.py), and the step
makes one marked call on the concatenated inputs. The graph dynamo captures is then already fused;
this pass checks that it is and counts the fused calls.

Traced unfused (the pass disabled):               Traced with the pass (what `run` receives):

    x_c = branch_input(x, "cond", "transformer", ...)   xs = branch_input(cat([x, x]), "cond+uncond", ...)
    <blocks ... on x_c, e_c>          # copy 1          es = branch_input(cat([pe, ne]), "cond+uncond", ...)
    out_c = branch_output(y_c, "cond", ...)             <blocks ... on xs, es>    # one copy, batch 2B
    x_u = branch_input(x, "uncond", ...)                y = branch_output(y, "cond+uncond", ...)
    <blocks ... on x_u, e_u>          # copy 2          out_c, out_u = chunk(y, 2)
    out_u = branch_output(y_u, "uncond", ...)

A call whose result has several tensors marks each with its index (`branch_output(y, ..., index)`);
each is split back per branch. The cleanup tail removes the markers.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging

import torch
from torch import fx, nn

from fvgraph.contract import cfg_branches
from fvgraph.contract.cfg_branches import FUSED, FusesBranches
from fvgraph.passes.base import FxPass, PassContext, marker_nodes

log = logging.getLogger(__name__)


class CfgFusionPass(FxPass):
    name = "cfg_fusion"

    @contextlib.contextmanager
    def tracing(self, step: nn.Module):
        """The step's branches run as one call while it is traced (eager calls stay unfused)."""
        if not isinstance(step, FusesBranches):
            yield
            return
        step.fuse_branches = True
        try:
            yield
        finally:
            step.fuse_branches = False

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        outputs = marker_nodes(gm.graph, torch.ops.fvgraph.branch_output)
        fused = [node for node in outputs if node.args[1] == FUSED]
        if fused:
            ctx.changed[self.name] = len(fused)  # outputs of fused calls, each split back per branch
        elif {node.args[1] for node in outputs} >= {"cond", "uncond"}:
            log.warning("cfg_fusion: the step calls its CFG branches one by one (it has no `fuse_branches`); left unfused")
        return gm

    def uuid(self) -> str:
        """Also changes with the fused call the step makes (fvgraph/contract/cfg_branches.py)."""
        digest = hashlib.sha256(super().uuid().encode())
        digest.update(inspect.getsource(cfg_branches).encode())
        return digest.hexdigest()[:16]
