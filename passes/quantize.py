"""FP8 quantization: linears onto their FP8 weights, and the block prologue fused with the activation quant.

Runs only when enabled (opt level 3) and only on linears that `fvgraph.kernels.fp8_weights.apply_fp8_weights`
gave FP8 buffers: layers a card excludes have none and are never touched, and a graph without FP8
buffers is left as it is. It runs after hoisting, on the step graph: the request prologue (text
embedding, cross-attention K/V, run once per request) keeps its full-precision linears.

1. Linears. A `linear(x, W, b)` whose W is the placeholder of parameter `<p>.weight`, with
   placeholders `<p>.fp8_weight` and `<p>.fp8_scale` beside it, becomes `fvgraph::fp8_linear`
   (dynamic per-row activation quantization inside).
2. Block prologue. Wan's `(layer_norm(h.float()) * (1 + scale) + shift).type_as(h)` whose every user
   is now an FP8 linear (self-attention q, k, v; the first FFN linear) becomes one
   `fvgraph::norm_modulate_quant`, whose FP8 rows and scales feed `fvgraph::fp8_linear_prequant` for
   each user: one pass over the activations, and one quantization serves q, k and v. When some user
   stays full precision (an excluded block, a mixed layer) the pattern is left alone: inductor
   already fuses that elementwise chain, and an opaque op there would only stop it.

Before (one block, with placeholders named by their parameters):

    n = layer_norm(h.float().float(), (D,), None, None, 1e-6).to(float32)
    m = (n * (1 + scale_msa) + shift_msa).type_as(h)
    q = linear(m, blocks.0.attn1.to_q.weight, blocks.0.attn1.to_q.bias)      # k, v alike
    o = linear(a, blocks.0.attn1.to_out.0.weight, blocks.0.attn1.to_out.0.bias)

After:

    mq = norm_modulate_quant(h, shift_msa, scale_msa, 1e-6)
    q = fp8_linear_prequant(mq[0], mq[1], to_q.fp8_weight, to_q.fp8_scale, to_q.bias, float32)  # k, v alike
    o = fp8_linear(a, to_out.0.fp8_weight, to_out.0.fp8_scale, to_out.0.bias)

`ctx.changed["quantize"]` counts linears swapped plus prologues fused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

import fvgraph.kernels.fp8_linear  # noqa: F401  (registers fvgraph::fp8_linear, fvgraph::fp8_linear_prequant)
import fvgraph.kernels.norm_modulate  # noqa: F401  (registers fvgraph::norm_modulate_quant)
from fvgraph.kernels.fp8_weights import FP8_SCALE, FP8_WEIGHT
from fvgraph.passes.base import FxPass, PassContext, eliminate_dead_code, step_parameters

FP8_LINEAR = torch.ops.fvgraph.fp8_linear.default
FP8_LINEAR_PREQUANT = torch.ops.fvgraph.fp8_linear_prequant.default
NORM_MODULATE_QUANT = torch.ops.fvgraph.norm_modulate_quant.default

_LINEAR = (F.linear, torch.ops.aten.linear.default)  # dynamo records F.linear (== torch._C._nn.linear)
_LAYER_NORM = (F.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm.default)
_ADD = (operator.add, torch.add)
_MUL = (operator.mul, torch.mul)

# Where a weight's FP8 copy is: weight placeholder -> (fp8_weight placeholder, fp8_scale placeholder).
Fp8Weights = dict[fx.Node, tuple[fx.Node, fx.Node]]


class QuantizePass(FxPass):
    name = "quantize"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        fp8 = _fp8_weights(gm.graph, ctx)
        swapped = _swap_linears(gm.graph, fp8) if fp8 else 0
        fused = sum(_fuse_prologue(gm.graph, m) for m in _modulations(gm.graph)) if swapped else 0
        eliminate_dead_code(gm.graph)
        ctx.changed[self.name] = swapped + fused
        return gm


def _fp8_weights(graph: fx.Graph, ctx: PassContext) -> Fp8Weights:
    """Pair each weight placeholder with its FP8 buffers' placeholders, by parameter name."""
    names = list(step_parameters(ctx.root))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][: ctx.num_params]
    if len(names) != ctx.num_params or len(placeholders) != ctx.num_params:
        raise ValueError(
            f"quantize: ctx.num_params={ctx.num_params} but the step has {len(names)} parameters and buffers and "
            f"the graph {len(placeholders)} leading placeholders; capture and context must describe one step"
        )
    by_name = dict(zip(names, placeholders))
    dtypes = dict(zip(names, (t.dtype for t in ctx.example_args[: ctx.num_params])))
    suffix = "." + FP8_WEIGHT
    found: Fp8Weights = {}
    for name in names:
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)]
        weight, scale = by_name.get(prefix + ".weight"), by_name.get(f"{prefix}.{FP8_SCALE}")
        if weight is None or scale is None:
            continue
        if dtypes[name] != torch.float8_e4m3fn:
            raise ValueError(
                f"quantize: buffer {name!r} is {dtypes[name]}, not float8_e4m3fn; the module was cast after "
                "apply_fp8_weights (module.to(dtype) casts float8 buffers too): apply it after the final cast"
            )
        found[weight] = (by_name[name], scale)
    return found


def _linear_args(node: fx.Node) -> tuple:
    """(input, weight, bias) of a linear call, however dynamo passed them."""
    names = ("input", "weight", "bias")
    values = dict(zip(names, node.args))
    values.update((k, v) for k, v in node.kwargs.items() if k in names)
    return values.get("input"), values.get("weight"), values.get("bias")


def _swap_linears(graph: fx.Graph, fp8: Fp8Weights) -> int:
    swapped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        x, weight, bias = _linear_args(node)
        if weight not in fp8:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(FP8_LINEAR, (x, *fp8[weight], bias))
        _replace(node, new)
        swapped += 1
    return swapped


def _replace(old: fx.Node, new: fx.Node) -> None:
    new.meta = dict(old.meta)  # same shape and dtype; keeps nn_module_stack for readers of the graph
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


@dataclass(frozen=True)
class _Modulation:
    """One matched `(layer_norm(h.float()) * (1 + scale) + shift).type_as(h)`; `out` is the type_as."""

    out: fx.Node
    h: fx.Node
    shift: fx.Node
    scale: fx.Node
    eps: float


def _modulations(graph: fx.Graph) -> list[_Modulation]:
    return [m for node in graph.nodes if (m := _match_modulation(node)) is not None]


def _match_modulation(node: fx.Node) -> _Modulation | None:
    if node.op != "call_method" or node.target != "type_as" or len(node.args) != 2 or node.kwargs:
        return None
    value, h = node.args
    for product, shift in _operands(value, _ADD):
        for normed, one_plus in _operands(product, _MUL):
            scale, eps = _one_plus(one_plus), _layer_norm_eps(normed, h)
            if scale is not None and eps is not None and isinstance(shift, fx.Node) and _rank3(node, h, shift, scale):
                return _Modulation(node, h, shift, scale, eps)
    return None


def _operands(node, targets) -> list[tuple]:
    """Both orders of a commutative binary call's operands, or [] when `node` is not one."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets):
        return []
    if len(node.args) != 2 or node.kwargs:  # torch.add(..., alpha=) is not a plain sum
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _one_plus(node) -> fx.Node | None:
    """`scale` when node is `1 + scale` (either order), else None."""
    for one, scale in _operands(node, _ADD):
        if isinstance(scale, fx.Node) and type(one) in (int, float) and one == 1:
            return scale
    return None


def _layer_norm_eps(normed, h: fx.Node) -> float | None:
    """eps when `normed` is an affine-free last-dim layer_norm of `h` upcast to fp32, else None."""
    ln = _strip_fp32_casts(normed)
    if not (isinstance(ln, fx.Node) and ln.op == "call_function" and ln.target in _LAYER_NORM):
        return None
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    args = {**dict(zip(names, ln.args)), **ln.kwargs}
    shape = args.get("normalized_shape")
    if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1):  # the last dim alone
        return None
    if args.get("weight") is not None or args.get("bias") is not None:
        return None
    if _strip_fp32_casts(args["input"]) is not h:
        return None
    return float(args.get("eps", 1e-5))


def _strip_fp32_casts(node):
    """Follow `.float()` / `.to(torch.float32)` back to their source: casts up to fp32 lose nothing."""
    while isinstance(node, fx.Node) and node.op == "call_method" and _is_fp32_cast(node):
        node = node.args[0]
    return node


def _is_fp32_cast(node: fx.Node) -> bool:
    if node.target == "float":
        return len(node.args) == 1 and not node.kwargs
    fp32_args = (((torch.float32,), {}), ((), {"dtype": torch.float32}))
    return node.target == "to" and (node.args[1:], node.kwargs) in fp32_args


def _rank3(*nodes: fx.Node) -> bool:
    """The fused kernel takes x [B, S, D] with shift / scale [B, 1, D] or [B, S, D]."""
    values = [_value(n) for n in nodes]
    return all(isinstance(v, torch.Tensor) and v.dim() == 3 for v in values)


def _value(node: fx.Node):
    """The example value dynamo recorded for a node (None when the graph carries no meta)."""
    return node.meta.get("example_value", node.meta.get("val"))


def _fuse_prologue(graph: fx.Graph, mod: _Modulation) -> int:
    """Rewrite one matched prologue whose users are all FP8 linears of it; returns 1 if rewritten."""
    users = list(mod.out.users)
    if not users or not all(_fp8_linear_of(user, mod.out) for user in users):
        return 0
    out_dtype = _value(mod.out).dtype  # type_as(h): the users' output dtype; _rank3 made sure it is known
    # h, shift and scale all precede the matched value, which DCE removes once its users are gone.
    with graph.inserting_before(mod.out):
        quant = graph.call_function(NORM_MODULATE_QUANT, (mod.h, mod.shift, mod.scale, mod.eps))
        quant.meta["nn_module_stack"] = mod.out.meta.get("nn_module_stack", {})
        x_fp8 = graph.call_function(operator.getitem, (quant, 0))
        x_scale = graph.call_function(operator.getitem, (quant, 1))
        for user in users:
            _, w_fp8, w_scale, bias = user.args
            _replace(user, graph.call_function(FP8_LINEAR_PREQUANT, (x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)))
    return 1


def _fp8_linear_of(user: fx.Node, value: fx.Node) -> bool:
    """True when `user` is an fp8_linear whose input, and only its input, is `value`."""
    return user.target is FP8_LINEAR and user.args[0] is value and value not in user.args[1:]
