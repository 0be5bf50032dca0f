"""The pass interface: one class per file, a uuid from its source, and a context passed in (no globals)."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field

import torch
from torch import fx, nn


@dataclass
class PassContext:
    """What an FX pass may read, and where a pass that splits the graph leaves the extra pieces.

    `example_args` are the flat arguments of the captured graph: the step module's parameters and
    buffers first (`num_params` of them, in `root.named_parameters()` + `named_buffers()` order), then
    the step's inputs.
    """

    root: nn.Module
    example_args: list[torch.Tensor]
    num_params: int
    prologue: fx.GraphModule | None = None  # set by the hoisting pass
    hoisted: list[str] = field(default_factory=list)  # names of the prologue outputs the step now takes
    changed: dict[str, int] = field(default_factory=dict)  # per pass: nodes rewritten (for logs and tests)


class FxPass:
    """A rewrite of a captured step graph, run before inductor. Subclasses implement `run`."""

    name: str = ""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        result = self.run(gm, ctx)
        result.graph.lint()
        result.recompile()
        return result

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    def uuid(self) -> str:
        """Changes whenever the pass's code does, so caches keyed on it never serve a stale rewrite."""
        source = inspect.getsource(type(self))
        return hashlib.sha256(source.encode()).hexdigest()[:16]


def marker_nodes(graph: fx.Graph, op) -> list[fx.Node]:
    """Nodes calling a marker op, whether dynamo recorded the overload or its packet."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
