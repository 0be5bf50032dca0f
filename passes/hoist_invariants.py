"""Step-invariant hoisting: compute what depends only on request constants and weights once per request.

Inside a denoise step the prompt embeddings never change between steps, so neither do the text
embedding projection nor every block's cross-attention K/V of those embeddings. This pass moves them
to a per-request *prologue* graph; the step graph takes the prologue's results as extra inputs.

Before (one graph, every step):

    pe = request_constant(prompt_embeds)
    e = linear(gelu(linear(pe, w1)), w2)              # text embedding
    k_i, v_i = linear(e, wk_i), linear(e, wv_i)       # per block cross-attention K/V
    ... attention(q(x), k_i, v_i) ...

After:

    prologue(*args) -> (k_0, v_0, ..., k_n, v_n)      # run once per request
    step(*args, k_0, v_0, ..., k_n, v_n)              # k_i, v_i are placeholders now

A node is hoisted when every input is a request constant, a weight (the first `num_params`
placeholders, or a module attribute) or another hoisted node, and it depends on the data of at least
one request constant (not only on its shape). Weight-only nodes stay in the step: they are free views
or constant-folded by inductor. So does a tensor whose leading dim is not a multiple of the batch
(the first m rows of each branch, an adapter step's rows-first slice: fvgraph/adapters/slots.py):
the runtime keeps hoisted values by request rows, so such a slice is taken in the step, of a
hoisted value that holds every row.
The prologue takes the same arguments as the step (it ignores the ones it does not need), so the
runtime calls both the same way.
"""

from __future__ import annotations

import torch
from torch import fx

from fvgraph.contract.markers import MARKER_OPS
from fvgraph.passes.base import FxPass, PassContext, eliminate_dead_code, marker_nodes


class HoistInvariantsPass(FxPass):
    name = "hoist_invariants"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        hoisted = {n for n in _hoistable(gm.graph, ctx.num_params) if _rows_per_request(n, ctx.batch)}
        frontier = [n for n in gm.graph.nodes if n in hoisted and any(u not in hoisted for u in n.users)]
        frontier = [n for n in frontier if _is_tensor(n)]
        if not frontier:
            return gm
        ctx.prologue = _prologue(gm, frontier)
        ctx.hoisted = [f"hoisted_{i}" for i in range(len(frontier))]

        graph = gm.graph
        first_compute = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first_compute):
            for name, node in zip(ctx.hoisted, frontier):
                placeholder = graph.placeholder(name)
                placeholder.meta = dict(node.meta)
                node.replace_all_uses_with(placeholder, delete_user_cb=lambda user: user not in hoisted)
        ctx.changed[self.name] = eliminate_dead_code(graph)
        return gm


def _hoistable(graph: fx.Graph, num_params: int) -> set[fx.Node]:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    weights = set(placeholders[:num_params]) | {n for n in graph.nodes if n.op == "get_attr"}
    invariant = set(weights)
    depends_on_request = set(marker_nodes(graph, torch.ops.fvgraph.request_constant))
    invariant |= depends_on_request
    for node in graph.nodes:
        if node in invariant or node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node.is_impure() or _is_random(node):
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in invariant for i in inputs):
            invariant.add(node)
            if _carries_data(node) and any(i in depends_on_request for i in inputs):
                depends_on_request.add(node)
    # A marker is an identity of a step input: hoisting it would only pass the input in twice.
    return {n for n in depends_on_request if n.target not in _MARKERS}


_MARKERS = {*MARKER_OPS, *(op.overloadpacket for op in MARKER_OPS)}


def _is_random(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    return any(word in name for word in ("rand", "dropout", "normal_", "bernoulli"))


def _carries_data(node: fx.Node) -> bool:
    """False for a shape query (a size, a dimension: a value with no tensor in it). A request's shapes
    are fixed by the step's signature, so what is built from them alone (Flux's text position ids,
    zeros of the text's length) is the same for every request and every row: it stays in the step,
    where it is a constant, instead of being split across the batch as if it were per request."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is None:
        return True  # unknown: assume it does
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) for v in values)


def _rows_per_request(node: fx.Node, batch: int) -> bool:
    """Whether a node's value splits into the batch's requests by rows (what the runtime keeps per
    request); a value that is not a tensor is judged by its tensor users."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor):
        return True
    return value.dim() > 0 and value.shape[0] % batch == 0


def _is_tensor(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(value, torch.Tensor)


def _prologue(gm: fx.GraphModule, frontier: list[fx.Node]) -> fx.GraphModule:
    """A copy of the graph that returns the frontier values and keeps only what they need."""
    graph, copies = fx.Graph(), {}
    graph.graph_copy(gm.graph, copies)  # every node but the output, meta shared
    graph.output(tuple(copies[n] for n in frontier))
    # A functional collective's wait is impure to fx's DCE, so the step's collectives (a parallel
    # step's all-gather, all-to-alls) would stay in the copy with nothing reading them. Every rank
    # builds the same copy, so dropping them keeps the ranks in step.
    eliminate_dead_code(graph)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional.wait_tensor") and not node.users:
            graph.erase_node(node)
    eliminate_dead_code(graph)
    return fx.GraphModule(gm, graph)
