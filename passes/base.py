"""The pass interface: one class per file, a uuid from its source, and a context passed in (no globals)."""

from __future__ import annotations

import abc
import contextlib
import hashlib
import inspect
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from fvgraph.contract import block_copies  # noqa: F401  (registers the block copy ops the DCE knows)


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
    batch: int = 1  # the batch the step is compiled at (dim 0 of its inputs; fused CFG doubles it inside)
    prologue: fx.GraphModule | None = None  # set by the hoisting pass
    hoisted: list[str] = field(default_factory=list)  # names of the prologue outputs the step now takes
    extra_outputs: list[str] = field(default_factory=list)  # names of outputs a pass appended (taps)
    changed: dict[str, int] = field(default_factory=dict)  # per pass: nodes rewritten (for logs and tests)


class FxPass(abc.ABC):
    """A rewrite of a captured step graph, run before inductor. Subclasses implement `run`."""

    name: str = ""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        result = self.run(gm, ctx)
        result.graph.lint()
        result.recompile()
        return result

    @abc.abstractmethod
    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule: ...

    def tracing(self, step: nn.Module) -> contextlib.AbstractContextManager:
        """What the pass sets on the step while dynamo traces it, before `run` sees the graph (CFG
        fusion: both branches as one call). Most passes rewrite the captured graph alone."""
        return contextlib.nullcontext()

    def uuid(self) -> str:
        """Changes whenever the pass's code does (its whole file, helpers included, and this base file
        with the shared dead-code elimination), so caches keyed on it never serve a stale rewrite."""
        digest = hashlib.sha256()
        for module in (inspect.getmodule(type(self)), inspect.getmodule(FxPass)):
            digest.update(inspect.getsource(module).encode())
        return digest.hexdigest()[:16]


def marker_nodes(graph: fx.Graph, op) -> list[fx.Node]:
    """Nodes calling a marker op, whether dynamo recorded the overload or its packet."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in (op, op.default)]


# Ops that return a fresh tensor: writes into their result are invisible once the result is unread.
_ALLOCATING = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty, torch.zeros,
               torch.ones, torch.full, torch.clone}  # fmt: skip


def eliminate_dead_code(graph: fx.Graph) -> int:
    """fx's DCE, plus writes into freshly allocated tensors that nothing reads any more, and block
    offload's copies into a slot that nothing reads before the slot is written again (with their waits).

    Models fill buffers in place (`out = empty_like(x); out[..., 0::2] = ...`); fx keeps every
    `setitem` as a side effect, and with it the whole computation feeding it. A write whose target
    was allocated in the graph and has no reader left is dead. Returns the number of nodes removed.
    """
    before = len(graph.nodes)
    while True:
        graph.eliminate_dead_code()
        dead_writes = [
            node
            for node in graph.nodes
            if node.op == "call_function"
            and node.target is operator.setitem
            and isinstance(node.args[0], fx.Node)
            and node.args[0].target in _ALLOCATING
            and all(user.target is operator.setitem and user.args[0] is node.args[0] for user in node.args[0].users)
        ]
        dead_writes += _unread_block_copies(graph)
        if not dead_writes:
            return before - len(graph.nodes)
        for node in dead_writes:
            graph.erase_node(node)


def step_parameters(step: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(step.named_parameters()), **dict(step.named_buffers())}


_BLOCK_COPY_OPS = (torch.ops.fvgraph.fetch_group, torch.ops.fvgraph.wait_group)
_BLOCK_COPIES = {*_BLOCK_COPY_OPS, *(op.default for op in _BLOCK_COPY_OPS)}


def _unread_block_copies(graph: fx.Graph) -> list[fx.Node]:
    """`fvgraph::fetch_group` nodes (fvgraph/contract/block_copies.py) whose slot no node reads before
    the next fetch into it, and the waits on that slot in between. The op is impure, so fx keeps it
    where the blocks that read the copy were removed: a CFG step's unfused branches after fusion, a
    prologue that keeps only the cross-attention K/V of the blocks."""
    nodes = list(graph.nodes)
    fetches = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.target in (torch.ops.fvgraph.fetch_group,
               torch.ops.fvgraph.fetch_group.default)]  # fmt: skip
    dead = []
    for k, i in enumerate(fetches):
        slot = set(nodes[i].args[0])
        end = next((j for j in fetches[k + 1 :] if slot & set(nodes[j].args[0])), len(nodes))
        between = nodes[i + 1 : end]
        readers = {u for s in slot for u in s.users if u.target not in _BLOCK_COPIES}
        if not readers.intersection(between):
            dead.append(nodes[i])
            dead += [n for n in between if n.target in _BLOCK_COPIES and slot & set(n.args[0]) and n.target not in
                     (torch.ops.fvgraph.fetch_group, torch.ops.fvgraph.fetch_group.default)]  # fmt: skip
    return dead
