"""A denoise step's CFG branches: one denoiser call per branch, or, fused, one call at twice the batch.

Each branch's call sits between branch markers (fvgraph/contract/markers.py). Eager, the branches run
one after the other as diffusers' pipelines run them. While a step is traced with CFG fusion
(passes/cfg_fusion.py sets the step's `fuse_branches` for the trace), the branches' inputs are
concatenated along the batch, the denoiser runs once on them, and each output is split back:

    cond:   y_c = transformer(x, t, pe)            fused:  y = transformer(cat([x, x]), cat([t, t]), cat([pe, ne]))
    uncond: y_u = transformer(x, t, ne)                    y_c, y_u = y.chunk(2)

so the traced graph holds one copy of the denoiser, at batch 2B: half the weight traffic and the
launches, and taller GEMMs. The fused call is marked as the branch FUSED, for the pass to find.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from fvgraph.contract.markers import mark_branch_inputs, mark_branch_output

FUSED = "cond+uncond"  # the branch name of a fused call's markers


@runtime_checkable
class FusesBranches(Protocol):
    """A step module whose CFG branches can be traced as one call (True only while traced so)."""

    fuse_branches: bool


def call_branches(module: str, call: Callable[..., tuple[torch.Tensor, ...]], branches: dict[str, dict[str, torch.Tensor]],
                  fused: bool) -> dict[str, tuple[torch.Tensor, ...]]:  # fmt: skip
    """{branch: the outputs of `call(**inputs)`} for each branch's keyword inputs, in order.

    `module` names the submodule `call` runs (for the markers); `call` returns a tuple of tensors.
    With `fused`, and two or more branches taking the same arguments, one call on the concatenated
    inputs serves them all."""
    names = list(branches)
    if not fused or len(names) < 2:
        return {branch: _marked_call(branch, module, call, inputs) for branch, inputs in branches.items()}
    arguments = list(branches[names[0]])
    for branch in names[1:]:
        if list(branches[branch]) != arguments:
            raise ValueError(f"CFG fusion: branch {branch!r} calls {module} with arguments {list(branches[branch])}, "
                             f"branch {names[0]!r} with {arguments}; fused branches must take the same arguments")  # fmt: skip
    batched = {arg: torch.cat([branches[branch][arg] for branch in names], dim=0) for arg in arguments}
    outputs = _marked_call(FUSED, module, call, batched)
    parts = [out.chunk(len(names), dim=0) for out in outputs]
    return {branch: tuple(part[i] for part in parts) for i, branch in enumerate(names)}


def _marked_call(branch: str, module: str, call: Callable[..., tuple[torch.Tensor, ...]],
                 inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    marked = dict(zip(inputs, mark_branch_inputs(branch, module, **inputs)))
    outputs = call(**marked)
    return tuple(mark_branch_output(branch, module, out, index) for index, out in enumerate(outputs))
