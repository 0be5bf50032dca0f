"""Adapter slots: every linear of the denoiser (or those `target_modules` names) with a fixed number of LoRA
slots beside it, chosen per batch row.

    store = install_slots(transformer, LoraSlots(max_loras=4, max_lora_rank=64, max_loras_per_request=2))
    store.write(slot, lora)                      # in place: compiled steps and CUDA graphs stay valid
    transformer(x, t, text, lora_index=index, lora_scale=scale)   # index, scale: [B, K] per batch row

Each target linear `name` gets, in `store.targets[name]` (non-persistent buffers, so never in a
state_dict, a checkpoint or the weights version):

    down    [S, R, in]   slot s's lora_A, zero-padded from its rank r to the slot rank R
    up      [S, R, out]  slot s's lora_B, transposed and padded the same way
    bias    [S, out]     slot s's lora_B bias (zero when the file has none)
    scaling [S]          slot s's alpha / r for this module (zero in an empty slot)

and its forward becomes `W x + b + sum_k scale[n, k] * scaling[i] * up_i (down_i x)` with
`i = index[n, k]`, for each batch row n: one gather of the rows' slots and two batched GEMMs of
width K * R beside the base GEMM. A row that uses fewer than K adapters (or none) has scale 0 in the
rest. A batch runs with only the K its rows use, with no rows (the base linear alone) when none
uses an adapter, and with its adapter rows first and the low-rank work on those alone when some do
(`SlotStore.rows_first`, fvgraph/runtime/adapter_variant.py). The row tensors enter the denoiser call as two keyword arguments, which a forward pre-hook on
the called module takes off and holds for the call's duration; being arguments of the call, they
are marked, concatenated and hoisted like any other input by the CFG-fusion and hoisting passes.

Loading an adapter writes its factors into slot storage in place (a buffer copy, no new tensor), so
the compiled graphs (which take the buffers as arguments) and captured CUDA graphs (which read their
addresses) see it at the next step; the slot count, rank and per-request count are what the
compiled step is built for (the signature's `adapters` factor), never which adapter is in a slot.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from dataclasses import dataclass
from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from fvgraph.adapters.lora_file import AdapterError, LoraWeights

ROW_INPUTS = ("lora_index", "lora_scale")  # the step inputs that choose each row's slots and scales


@dataclass(frozen=True)
class LoraSlots:
    """How many adapters an engine holds at once, how large, and how many one request may combine."""

    max_loras: int = 4  # slots: adapters loaded at once (vLLM's name)
    max_lora_rank: int = 64  # every slot's rank; an adapter of a higher rank is refused
    max_loras_per_request: int = 2  # adapters one request (one batch row) may combine
    # The linears that get slots, by peft's rule (a name, or its last dotted parts: "to_q" is every
    # block's attention query); None: every linear of the denoiser. Every slotted linear runs its
    # low-rank GEMMs for an adapter row whether or not the row's adapter has factors there, so naming
    # what the served adapters adapt keeps the step at their FLOPs (--lora-target-modules).
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_loras_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                raise ValueError(f"{name}={value!r} must be an int in [1, 1024]")
        if self.max_loras_per_request > self.max_loras:
            raise ValueError(f"max_loras_per_request={self.max_loras_per_request} exceeds max_loras={self.max_loras}")
        targets = self.target_modules
        if targets is not None and (isinstance(targets, str) or not isinstance(targets, (tuple, list)) or not targets
                                    or not all(isinstance(t, str) and t.strip(".") == t and t for t in targets)):  # fmt: skip
            raise ValueError(f"target_modules={targets!r} must be a non-empty list of module names, like ['to_q', 'to_v']")
        if isinstance(targets, list):
            object.__setattr__(self, "target_modules", tuple(targets))

    def has_slots(self, name: str) -> bool:
        """Whether the linear `name` gets slots (peft's matching: the name, or a dotted suffix of it)."""
        return self.target_modules is None or any(name == t or name.endswith("." + t) for t in self.target_modules)


class _RowChoice:
    """The current call's row tensors, or None outside a call that passed them; and, while a batch
    runs with its adapter rows first, how many (`first`, of each `bucket` rows per branch)."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.first: tuple[int, int] | None = None  # (m, bucket): only rows [0, m) of each branch use adapters


class TargetSlots(nn.Module):
    """The slot storage of one linear."""

    def __init__(self, linear: nn.Linear, slots: LoraSlots):
        super().__init__()
        out_features, in_features = linear.weight.shape
        like = dict(dtype=linear.weight.dtype, device=linear.weight.device)
        s, r = slots.max_loras, slots.max_lora_rank
        self.register_buffer("down", torch.zeros(s, r, in_features, **like), persistent=False)
        self.register_buffer("up", torch.zeros(s, r, out_features, **like), persistent=False)
        self.register_buffer("bias", torch.zeros(s, out_features, **like), persistent=False)
        self.register_buffer("scaling", torch.zeros(s, dtype=torch.float32, device=like["device"]), persistent=False)


class SlotStore(nn.Module):
    """Every target linear's slots, and which adapter (by digest) each slot holds."""

    def __init__(self, transformer: nn.Module, slots: LoraSlots):
        super().__init__()
        self.slots = slots
        names = [name for name, m in transformer.named_modules() if type(m) is nn.Linear and slots.has_slots(name)]
        if not names:
            raise ValueError(f"target_modules={list(slots.target_modules)} names no linear of this denoiser")
        self.names = names
        self.targets = nn.ModuleDict({_key(n): TargetSlots(transformer.get_submodule(n), slots) for n in names})
        self.digests: list[str | None] = [None] * slots.max_loras
        self.rows = _RowChoice()

    def cache_variant(self) -> Hashable:
        """What the current call's rows add to the denoiser, for the eager projection cache's key: per
        row, the (adapter digest, scale) pairs with a non-zero scale (None outside a call with rows).
        Reads the rows to the host: eager only."""
        if self.rows.index is None:
            return None
        index, scale = self.rows.index.tolist(), self.rows.scale.tolist()
        return tuple(tuple(sorted((self.digests[i], s) for i, s in zip(ri, rs) if s != 0.0)) for ri, rs in zip(index, scale))

    def choose(self, index: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """The row tensors the adapted linears read until `release` (None: the base layers alone)."""
        self.rows.index, self.rows.scale = index, scale

    def release(self) -> None:
        self.rows.index = self.rows.scale = None

    @contextlib.contextmanager
    def rows_first(self, m: int, bucket: int):
        """While inside: a call's rows past the first m of each `bucket` rows per branch use no adapter
        (the executor put its adapter rows first), so the low-rank work runs on those m rows alone.
        Read while a compiled step is traced: the step's signature must say m (adapter_variant.py)."""
        self.rows.first = (m, bucket)
        try:
            yield
        finally:
            self.rows.first = None

    def target(self, name: str) -> TargetSlots:
        return self.targets[_key(name)]

    def factor(self) -> str:
        """The signature factor: what the compiled step is built for (not which adapters are loaded)."""
        targets = hashlib.sha256("|".join(self.names).encode()).hexdigest()[:12]
        s = self.slots
        return f"lora-slots:{s.max_loras}x{s.max_lora_rank}/{s.max_loras_per_request}:{targets}"

    @torch.no_grad()
    def write(self, slot: int, lora: LoraWeights) -> None:
        """Put `lora` into `slot` in place (checked against the slots by the caller)."""
        self.clear(slot)
        for name, module in lora.modules.items():
            t = self.target(name)
            r = module.rank
            t.down[slot, :r].copy_(module.down)
            t.up[slot, :r].copy_(module.up.t())
            if module.up_bias is not None:
                t.bias[slot].copy_(module.up_bias)
            t.scaling[slot] = module.scaling
        self.digests[slot] = lora.digest

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for t in self.targets.values():
            t.down[slot].zero_()
            t.up[slot].zero_()
            t.bias[slot].zero_()
            t.scaling[slot] = 0.0
        self.digests[slot] = None

    def check(self, lora: LoraWeights) -> None:
        """AdapterError naming the key when `lora` does not fit these slots."""
        for name, module in lora.modules.items():
            if _key(name) not in self.targets:
                why = "" if self.slots.target_modules is None else f" (the engine's target_modules are {list(self.slots.target_modules)})"
                raise AdapterError(f"lora key transformer.{name}: not an adapted linear of this engine{why}")
            if module.rank > self.slots.max_lora_rank:
                raise AdapterError(f"lora key transformer.{name}.lora_A.weight has rank {module.rank} > max_lora_rank="
                                   f"{self.slots.max_lora_rank}: build the engine with a larger max_lora_rank")  # fmt: skip
            t = self.target(name)  # read for another denoiser (a two-expert card's other expert) it may not fit this one
            if module.down.shape[1] != t.down.shape[2] or module.up.shape[0] != t.up.shape[2]:
                raise AdapterError(f"lora key transformer.{name}.lora_A.weight: factors {list(module.down.shape)} and "
                                   f"{list(module.up.shape)} do not fit this denoiser's {name} "
                                   f"({t.down.shape[2]} -> {t.up.shape[2]})")  # fmt: skip


class SlotLinear:
    """A target linear's forward with its slots; installed as the module's instance `forward`.

    Holds the linear weakly (module -> forward -> module would be a cycle), and reads the slot
    buffers through their module at every call, so `functional_call` (the step capture) sees them."""

    def __init__(self, linear: nn.Linear, slots: TargetSlots, store: SlotStore):
        self._linear = weakref.ref(linear)
        self.slots = slots
        self.rows = store.rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self._linear()
        index, scale = self.rows.index, self.rows.scale
        y = F.linear(x, linear.weight, linear.bias)
        if index is None:  # a call that chose no slots (outside a step, or a batch with no adapter row)
            return y
        rows = index.shape[0]
        if x.shape[0] % rows:
            raise AdapterError(f"adapter rows: a linear's input has leading dim {x.shape[0]}, not a multiple of the {rows} batch rows")
        first = self.rows.first
        if first is None or rows % first[1] or first[0] >= first[1]:
            return add_low_rank(self.slots, y, x, index, scale).reshape(y.shape)
        return add_low_rank_first(self.slots, y, x, index, scale, *first)


def add_low_rank(t: TargetSlots, y: torch.Tensor, x: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y + each row's chosen slots' low-rank terms, [N, T, out] for the N rows of index [N, K]."""
    return add_gathered(y, x, *gathered(t, index, scale, x.dtype))


def add_gathered(y: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """add_low_rank after the gather (which a -O1 step hoists): one row per leading index of the factors."""
    rows = down.shape[0]
    h = torch.bmm(x.reshape(rows, -1, x.shape[-1]), down.transpose(1, 2))  # [N, T, K*R]
    # y + (low + bias) as plain adds, not a baddbmm onto y: compiled, both adds are one pass over the
    # output where baddbmm copies y first (perf/bench_lora_linear.py). The rows-first path below does
    # the same arithmetic, so a request's bits do not depend on the batch it runs in.
    return y.reshape(rows, -1, y.shape[-1]) + (torch.bmm(h, up) + bias)  # a row's tokens are contiguous


def add_low_rank_first(t: TargetSlots, y: torch.Tensor, x: torch.Tensor, index: torch.Tensor, scale: torch.Tensor,
                       m: int, bucket: int) -> torch.Tensor:  # fmt: skip
    """y + the low-rank terms of the first m requests of `bucket` (the adapter rows, put first), the
    rest y as it is. Each request's slots are gathered once for all its branches (their rows choose
    the same). Every tensor of the first m requests leads with m < bucket, so the hoisting pass keeps
    those slices in the step, of the factors it hoists for the whole bucket (passes/hoist_invariants.py)."""
    factors = (f[:m] for f in gathered(t, index[:bucket], scale[:bucket], x.dtype))  # [m, K*R, in], [m, K*R, out], [m, 1, out]
    return add_gathered_first(y, x, *factors, branches=index.shape[0] // bucket, bucket=bucket)


def add_gathered_first(y: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, bias: torch.Tensor,
                       branches: int, bucket: int) -> torch.Tensor:  # fmt: skip
    """add_low_rank_first after the gather: the factors of the first m requests, rows branch-major
    ([branch, bucket, T]), each request's branches' tokens through one GEMM."""
    m = down.shape[0]
    xs, ys = x.reshape(branches, bucket, -1, x.shape[-1]), y.reshape(branches, bucket, -1, y.shape[-1])
    tokens = ys.shape[2]
    xm = xs[:, :m].transpose(0, 1).reshape(m, branches * tokens, -1)  # [m, branches*T, in]
    low = torch.bmm(torch.bmm(xm, down.transpose(1, 2)), up) + bias  # [m, branches*T, out]
    top = ys[:, :m] + low.view(m, branches, tokens, -1).transpose(0, 1)
    # slice_scatter, not an in-place add: the step's passes take graphs without mutation. Compiled, it
    # is one fused pass the size of y (the adds and the copy of the other rows), as a cat was.
    return ys.slice_scatter(top, dim=1, start=0, end=m).reshape(y.shape)


def gathered(t: TargetSlots, index: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Each row's slot factors, down [N, K*R, in] with the scales folded in and up [N, K*R, out], and
    its scaled slot biases [N, 1, out]."""
    # Each place's scale folded into its gathered down factors ([N, K, R, in], weight-sized, not
    # activation-sized). A row's unused places (scale 0) point at slot 0, whatever it holds: their
    # factors become exact zeros (slot factors are finite, checked at load), so they add nothing.
    s = torch.where(scale != 0, scale * t.scaling[index], 0.0).to(dtype)  # [N, K]
    down = (t.down[index] * s[:, :, None, None]).flatten(1, 2)
    bias = (s.unsqueeze(-1) * t.bias[index]).sum(1, keepdim=True)
    return down, t.up[index].flatten(1, 2), bias


def install_slots(transformer: nn.Module, slots: LoraSlots) -> SlotStore:
    """Give every nn.Linear of `transformer` that `slots` targets its slots, and let `transformer` take the row tensors.
    The store becomes the submodule `fvgraph_lora_slots`, so a step module's buffers include it."""
    if hasattr(transformer, "fvgraph_lora_slots"):
        raise ValueError("install_slots: this transformer already has adapter slots")
    store = SlotStore(transformer, slots)
    transformer.add_module("fvgraph_lora_slots", store)
    for name in store.names:
        linear = transformer.get_submodule(name)
        if "forward" in linear.__dict__:
            raise ValueError(f"install_slots: {name} already has an instance forward; install slots before other wrappers")
        linear.forward = SlotLinear(linear, store.target(name), store)
    take_rows_on_call(transformer, store)
    return store


def take_rows_on_call(module: nn.Module, store: SlotStore) -> None:
    """`module(..., lora_index=i, lora_scale=s)`: the two row tensors are taken off the call's keyword
    arguments and chosen for the call's duration (module is the denoiser a step's branches call)."""

    def choose(_, args, kwargs):
        store.choose(kwargs.pop("lora_index", None), kwargs.pop("lora_scale", None))
        return args, kwargs

    def release(*_):
        store.release()

    module.register_forward_pre_hook(choose, with_kwargs=True)
    module.register_forward_hook(release)


def slot_store(transformer: nn.Module) -> SlotStore | None:
    """The slots `install_slots` gave `transformer`, if any."""
    store = getattr(transformer, "fvgraph_lora_slots", None)
    return store if isinstance(store, SlotStore) else None


def _key(name: str) -> str:
    return name.replace(".", "__")
