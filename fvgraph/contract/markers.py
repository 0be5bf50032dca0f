"""Region markers: identity custom ops a step body places in its traced graph for the passes to key on.

Dynamo inlines module calls, so in a captured step the two CFG branches are just two copies of the
denoiser's ops, and a prompt embedding is just another placeholder. The step body says what they are:

    x, t, e = mark_branch_inputs("cond", "transformer", hidden_states=x, timestep=t, encoder_hidden_states=e)
    out = mark_branch_output("cond", "transformer", transformer(..., return_dict=False)[0])  # index 0
    embeds = mark_request_constant(embeds)

In eager mode the helpers return their inputs untouched (no op runs). While tracing they emit
`fvgraph::branch_input`, `fvgraph::branch_output` and `fvgraph::request_constant` nodes; passes read
them, and the cleanup tail replaces every marker by its input before inductor sees the graph.
`fvgraph::tap` marks an intermediate tensor of a parity run's tap variant (fvgraph/loops/taps.py); the
tap-outputs pass turns each into an extra graph output.
"""

from __future__ import annotations

import torch

# The ops copy (custom ops may not return an alias of an input); the cleanup tail removes them, so the
# copy never reaches a compiled graph.


@torch.library.custom_op("fvgraph::branch_input", mutates_args=())
def branch_input(x: torch.Tensor, branch: str, module: str, arg: str) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("fvgraph::branch_output", mutates_args=())
def branch_output(x: torch.Tensor, branch: str, module: str, index: int = 0) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("fvgraph::request_constant", mutates_args=())
def request_constant(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("fvgraph::tap", mutates_args=())
def tap(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


for _op in (branch_input, branch_output, request_constant, tap):
    _op.register_fake(lambda x, *args: torch.empty_like(x))

MARKER_OPS = (
    torch.ops.fvgraph.branch_input.default,
    torch.ops.fvgraph.branch_output.default,
    torch.ops.fvgraph.request_constant.default,
    torch.ops.fvgraph.tap.default,
)


def mark_branch_inputs(branch: str, module: str, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tag the keyword inputs of one call of submodule `module` as the inputs of `branch`."""
    if not torch.compiler.is_compiling():
        return tuple(inputs.values())
    return tuple(torch.ops.fvgraph.branch_input(x, branch, module, arg) for arg, x in inputs.items())


def mark_branch_output(branch: str, module: str, x: torch.Tensor, index: int = 0) -> torch.Tensor:
    """Tag element `index` of what the call of `module` returns (return_dict=False) on `branch`."""
    if not torch.compiler.is_compiling():
        return x
    return torch.ops.fvgraph.branch_output(x, branch, module, index)


def mark_request_constant(x: torch.Tensor | None) -> torch.Tensor | None:
    """Tag an input that stays the same for every step of one request (e.g. prompt embeddings)."""
    if x is None or not torch.compiler.is_compiling():
        return x
    return torch.ops.fvgraph.request_constant(x)
