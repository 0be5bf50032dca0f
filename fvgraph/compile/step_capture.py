"""Capture a step module as one FX graph with dynamo, with a flat calling convention of our own.

The graph's arguments are the step's parameters and buffers (in `named_parameters()` then
`named_buffers()` order) followed by the step's inputs; it returns the step's outputs as a tuple in a
fixed key order. Parameters enter as arguments so passes can tell weights (the first `num_params`
placeholders) from per-step inputs. Capture is fullgraph: a graph break is an error that names the
step and the cause, never a silent split.

Dynamo traces the step once per capture, through `torch.compile` with a backend that keeps the graph
(`_keep_graph`); the passes then rewrite that graph, and nothing traces the step again. What a pass
needs decided before tracing (CFG fusion runs both branches as one batch) it sets on the step for the
duration of the trace (`PassManager.tracing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fvgraph.compile.quiet_logging import logging_calls_traced_as_no_ops
from fvgraph.passes.base import step_parameters


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
        gm = trace_graph(flat_step, args)
    except torch._dynamo.exc.TorchDynamoException as err:
        raise GraphBreakError(f"step {kind!r} does not trace as one graph: {err}") from err
    return CapturedStep(gm, param_names, input_names, output_names, args)


def trace_graph(fn, args: list[torch.Tensor]) -> fx.GraphModule:
    """One dynamo graph of `fn(*args)` (a tuple of tensors) whose placeholders are exactly `args`."""
    kept: dict = {}
    # Static shapes (one graph per signature); logging calls traced as no-ops (quiet_logging.py).
    # Parameters stay placeholders (functional_call reads them from `args`).
    with logging_calls_traced_as_no_ops(), torch.no_grad():
        try:
            result = torch.compile(fn, backend=_keep_graph(kept), fullgraph=True, dynamic=False)(*args)
        finally:
            torch._dynamo.eval_frame.remove_from_cache(fn)  # a later capture of the same code traces afresh
    if "gm" not in kept:  # the step computes nothing (its outputs are its inputs): dynamo made no graph
        empty = fx.Graph()
        empty.output(())
        kept.update(gm=fx.GraphModule(nn.Module(), empty), inputs=(), outputs=())
    return _flat_signature(kept["gm"], kept["inputs"], kept["outputs"], args, result)


def _keep_graph(kept: dict):
    """A dynamo backend that keeps the graph and, on its one call, the tensors it took and returned."""

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        if "gm" in kept:
            raise GraphBreakError("dynamo produced a second graph for one step")
        kept["gm"] = gm

        def run(*inputs):
            kept["inputs"], kept["outputs"] = inputs, gm(*inputs)
            return kept["outputs"]

        return run

    return backend


def _flat_signature(gm: fx.GraphModule, graph_inputs, graph_outputs, args: list[torch.Tensor],
                    result: tuple) -> fx.GraphModule:  # fmt: skip
    """Rewrite dynamo's graph to take every one of `args` in order and return `result`'s tensors.

    Dynamo's placeholders are the arguments it read, deduplicated, and its outputs the values it
    computed; which argument or output each one is, is known by identity of the tensors of the one
    call (as `torch._dynamo.export` matches them)."""
    graph = gm.graph
    position = {}
    for i, t in enumerate(args):
        position.setdefault(id(t), i)
    old = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(next(iter(graph.nodes))):
        new = [graph.placeholder(f"arg_{i}") for i in range(len(args))]
    for i, node in enumerate(new):
        node.meta["example_value"] = torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype, device="meta")
    for j, (node, value) in enumerate(zip(old, graph_inputs, strict=True)):
        if id(value) in position:
            new[position[id(value)]].meta = dict(node.meta)
            replacement = new[position[id(value)]]
        else:  # a tensor the step reads that is no parameter, buffer or input: a constant of the graph
            gm.register_buffer(f"_constant_{j}", value)
            with graph.inserting_before(node):
                replacement = graph.get_attr(f"_constant_{j}")
            replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    output = next(n for n in graph.nodes if n.op == "output")
    computed = {id(t): node for t, node in zip(graph_outputs, output.args[0], strict=True)}
    values = []
    for i, t in enumerate(result):
        source = computed.get(id(t))
        if source is None and id(t) in position:  # an input returned as it came
            source = new[position[id(t)]]
        if source is None:
            raise GraphBreakError(f"output {i} of the step is neither computed by the graph nor one of its inputs")
        values.append(source)
    output.args = (tuple(values),)
    graph._codegen = fx.graph.CodeGen()  # plain codegen: arguments = placeholders (passes add some)
    # Dynamo's map from its placeholders to the user's sources no longer holds: AOTAutograd would
    # read it and expect a source on each placeholder. Without it, the graph is read as an exported one.
    if hasattr(gm, "_param_name_to_source"):
        del gm._param_name_to_source
    graph.lint()
    gm.recompile()
    return gm
