"""Capture a step module as one FX graph with dynamo, with a flat calling convention of our own.

The graph's arguments are the step's parameters and buffers (in `named_parameters()` then
`named_buffers()` order) followed by the step's inputs; it returns the step's outputs as a tuple in a
fixed key order. Parameters enter as arguments so passes can tell weights (the first `num_params`
placeholders) from per-step inputs. Capture is fullgraph: a graph break is an error that names the
step and the cause, never a silent split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fvgraph.passes.base import export_graph, step_parameters


class GraphBreakError(RuntimeError):
    """A step function could not be traced as one graph."""


@dataclass
class CapturedStep:
    gm: fx.GraphModule
    param_names: list[str]
    input_names: list[str]
    output_names: list[str]
    example_args: list[torch.Tensor]

    @property
    def num_params(self) -> int:
        return len(self.param_names)


def capture_step(kind: str, step: nn.Module, inputs: dict[str, torch.Tensor]) -> CapturedStep:
    params = step_parameters(step)
    param_names, input_names = list(params), list(inputs)
    with torch.no_grad():
        # One eager run fixes the output order. Block taps of a parity tap variant are not among them
        # when traced: the tap-outputs pass appends those.
        output_names = [name for name in step(**inputs) if not name.startswith("tap.block.")]

    def flat_step(*tensors):
        weights = dict(zip(param_names, tensors[: len(param_names)]))
        kwargs = dict(zip(input_names, tensors[len(param_names) :]))
        out = torch.func.functional_call(step, weights, (), kwargs)
        return tuple(out[name] for name in output_names)

    args = [*params.values(), *inputs.values()]
    try:
        gm = export_graph(flat_step, args)
    except torch._dynamo.exc.TorchDynamoException as err:
        raise GraphBreakError(f"step {kind!r} does not trace as one graph: {err}") from err
    return CapturedStep(gm, param_names, input_names, output_names, args)
