"""Block offload's copies in a compiled step: written into the slots themselves, in program order.

`fvgraph::fetch_group` and `wait_group` (fvgraph/contract/block_copies.py) declare their slot
mutated, and AOTAutograd functionalizes every mutation: each call becomes

    out = auto_functionalized_v2(fetch_group, host=[...], group=g, _all_bases=[slot0_w, ..., copies])
    w = out[1]                      # a clone of the slot tensor, written by the op
    ... the blocks read w ...
    copy_(slot0_w, <last version>)  # at the end of the step: the clones copied back into the slot

Run as it stands (aot_eager), every call clones every slot tensor it writes: a step then holds up to
two more groups of weights than the slots, and copies each slot once more at its end. Rewritten here
(`aot_eager_in_place`), each call runs the op on the slot tensors themselves
(`_only_clone_these_bases=()`), and the copies back, now of a slot onto itself, are dropped. A call may
write a slot tensor in place when nothing reads the value it replaces after it; which holds in program
order (group g-1's blocks read its slot before the first block of group g fetches g+1 into it), the
order dynamo traced and AOTAutograd keeps. A tensor some later node still reads is cloned as before
(correct, only not bounded), and counted.

Inductor (`inductor_config`) needs two things more:
- Its reinplacing applies the same rule, but only after `reorder_for_locality`, which moves a block's
  reads next to their consumers, past the next fetch into the slot (a functional graph does not order
  them); those fetches then write clones. That reordering is off for a graph with block copies.
- Its fallback for a mutating op registers the op first and only then realizes the pending (not yet
  computed) values that read what it mutates, so they run after it: a block's last pointwise read of
  its slot (the gate of its residual add) was fused into the next group's first kernel and read the
  group fetched two later into the same slot (torch 2.13, on the CPU; with two groups each slot always
  holds the same group, which hid it). The copy ops' lowering realizes those readers first.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import operator
import sys
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2_dense
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_utils import get_node_storage

from fvgraph.contract import block_copies  # noqa: F401  (registers torch.ops.fvgraph.fetch_group / wait_group)

log = logging.getLogger(__name__)

BLOCK_COPY_OPS = (torch.ops.fvgraph.fetch_group.default, torch.ops.fvgraph.wait_group.default)


def holds_block_copies(gm: fx.GraphModule) -> bool:
    """Whether the (pre-AOTAutograd) graph calls the block copy ops."""
    ops = {*BLOCK_COPY_OPS, torch.ops.fvgraph.fetch_group, torch.ops.fvgraph.wait_group}
    return any(n.op == "call_function" and n.target in ops for n in gm.graph.nodes)


def inductor_config(gm: fx.GraphModule) -> dict:
    """Inductor config patches for compiling `gm` ({} without block copies); with them, the copies'
    lowering is registered in this process first (see the module docstring)."""
    if not holds_block_copies(gm):
        return {}
    register_lowerings()
    return {"reorder_for_locality": False, "post_grad_custom_post_pass": LoweringKey()}


class LoweringKey(CustomGraphPass):
    """Changes no graph: puts this file's source into inductor's cache keys, which see its config and
    passes but not a registered lowering."""

    def __call__(self, graph: fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:16]


@functools.cache
def register_lowerings() -> None:
    """The copy ops' inductor lowering: realize what reads the tensors an op writes, then the fallback
    inductor would use. (A process building an inductor graph with block copies calls this first.)"""
    from torch._inductor.lowering import fallback_handler, register_lowering

    for op in BLOCK_COPY_OPS:
        register_lowering(op, type_promotion_kind=None)(_readers_first(op, fallback_handler(op, add_to_fallback_set=False)))


def _readers_first(op: torch._ops.OpOverload, fallback):
    from torch._inductor.virtualized import V
    from torch.utils import _pytree as pytree

    def lower(*args, **kwargs):
        for info, value in torch._library.utils.zip_schema(op._schema, args, kwargs):
            if info.alias_info is not None and info.alias_info.is_write:
                for tensor in pytree.tree_leaves(value):
                    V.graph.mark_buffer_mutated(tensor.get_name())  # realizes its pending readers now
        return fallback(*args, **kwargs)

    return lower


def aot_eager_in_place(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """dynamo's aot_eager backend, with the block copies of the forward graph written in place."""
    return aot_eager(gm, example_inputs, fw_compiler=_in_place_nop)


def _in_place_nop(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    in_place, cloned = write_block_copies_in_place(gm)
    if cloned:
        log.warning("block offload: %d of %d slot copies in a compiled step write a clone of their slot (a "
                    "later node reads the value they replace); the step holds more than two groups",
                    cloned, in_place + cloned)  # fmt: skip
    return boxed_nop(gm, example_inputs)


def write_block_copies_in_place(gm: fx.GraphModule) -> tuple[int, int]:
    """Rewrite a functionalized graph's block copies to write their slot tensors themselves where
    nothing reads the replaced value later. Returns (calls now wholly in place, calls still cloning)."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    by_storage: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if (storage := get_node_storage(node)) is not None:
            by_storage.setdefault(storage, []).append(node)
    written_back = {n.args[0]: n for n in graph.nodes
                    if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"}  # fmt: skip
    in_place = cloned = 0
    for node in list(graph.nodes):
        if not (node.target is torch.ops.higher_order.auto_functionalized_v2 and node.args[0] in BLOCK_COPY_OPS):
            continue
        bases = node.kwargs["_all_bases"]
        clone = tuple(i for i, base in enumerate(bases) if not _writable(base, node, order, by_storage, written_back))
        node.target = auto_functionalized_v2_dense
        node.kwargs = {**node.kwargs, "_only_clone_these_bases": clone}
        in_place, cloned = in_place + (not clone), cloned + bool(clone)
    for copy in list(written_back.values()):
        if _same_tensor(copy.args[1]) is copy.args[0]:  # a slot copied onto itself
            graph.erase_node(copy)
    graph.lint()
    gm.recompile()
    return in_place, cloned


def _writable(base: fx.Node, node: fx.Node, order: dict, by_storage: dict, written_back: dict) -> bool:
    """Whether `node` may overwrite `base`: no later node reads it (or a view of it), and a graph input
    is one the step writes back into at its end (the program means to change it)."""
    if base.op == "placeholder" and base not in written_back:
        return False
    aliases = by_storage.get(get_node_storage(base), [base])
    readers = {user for alias in aliases for user in alias.users} - {node, written_back.get(base)}
    return all(order[reader] < order[node] for reader in readers)


def _same_tensor(value: fx.Node) -> fx.Node:
    """The tensor `value` is once the in-place calls are run: through `getitem`s of calls that wrote
    their base in place, the slot tensor they wrote."""
    while value.target is operator.getitem and value.args[0].target is auto_functionalized_v2_dense:
        call, index = value.args[0], value.args[1] - 1  # the op returns nothing: item 0 is None, then the bases
        if index < 0 or index in call.kwargs["_only_clone_these_bases"]:
            return value
        value = call.kwargs["_all_bases"][index]
    return value
