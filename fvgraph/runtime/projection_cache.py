"""Exact reuse of conditioning projections across denoise steps.

A diffusion transformer often projects the same conditioning (a pooled text embedding, a guidance
embedding) through the same weights at every step. ``ExactProjectionCache`` keeps the real output
and returns it while its key still holds: projection name, conditioning content hash, identity,
storage and version of every weight/buffer, and the numerical settings of the ``project()`` call.
What the key cannot see (compilation, CUDA-graph capture, autograd, hooks, unversioned or subclass
weights) runs the original computation instead. ``prepare(conditioning)`` hashes a conditioning
once, before the projections that read it; ``project()`` hashes an unprepared one itself on first
use. The cache is per process and never communicates: a parallel engine runs without it
(fvgraph/engine/builder.py).
See docs/projection_cache.md for usage and integration rules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections import OrderedDict
from typing import Callable, Hashable, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _nn_module

# Bypass reasons: why a call ran compute() without reading or writing the cache.
COMPILING = "compiling"
CUDA_GRAPH_CAPTURE = "cuda_graph_capture"
GRAD_ENABLED = "grad_enabled"
GLOBAL_HOOKS = "global_hooks"
MODULE_HOOKS = "module_hooks"
INFERENCE_WEIGHTS = "unversioned_inference_weights"
SUBCLASS_WEIGHTS = "tensor_subclass_weights"
TOO_LARGE = "too_large"


@dataclasses.dataclass
class ProjectionCacheStats:
    """Counters for one cache. Every eager ``project()`` call adds exactly one to ``hits``,
    ``misses`` or one ``bypasses`` reason; ``bypasses["compiling"]`` counts traces, not calls of the
    compiled code."""

    hits: int = 0
    """Calls answered from the cache."""
    misses: int = 0
    """Calls that ran ``compute()`` and stored its output."""
    bypasses: dict[str, int] = dataclasses.field(default_factory=dict)
    """Calls that ran ``compute()`` without reading or writing the cache, by reason."""
    invalidations: int = 0
    """Entries dropped because a projection weight/buffer changed identity, storage or version."""
    evictions: int = 0
    """Entries dropped to stay within ``max_bytes``."""
    hashes: int = 0
    """Conditionings hashed (once per tensor object, and again after it is changed in place)."""
    unprepared_hashes: int = 0
    """Of ``hashes``, those ``project()`` did itself because no ``prepare()`` had seen the tensor."""
    bytes_held: int = 0
    """Bytes of storage kept alive by cached outputs."""
    entries: int = 0
    """Number of cached outputs."""


@dataclasses.dataclass(frozen=True)
class ConditioningKey:
    """Content identity of a conditioning tensor: a digest of its bytes plus its layout facts."""

    digest: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # layouts can select different kernels, hence different rounding
    device: str


class _Hashed(NamedTuple):
    ref: weakref.ref
    storage: weakref.ref
    data_ptr: int
    version: int | None  # None for inference tensors, which have no version counter
    key: ConditioningKey


class _Entry(NamedTuple):
    weights: tuple
    storages: tuple[weakref.ref, ...]  # dead once a weight storage is freed, even if its address
    output: Tensor  # is later reused by another allocation
    nbytes: int


class ExactProjectionCache:
    """Bit-exact cache of projection outputs keyed by conditioning content, weights and numerics.

    Outputs returned on a hit are the stored tensors themselves: callers must not modify them.
    Keep one cache per model instance, and a separate one for each concurrent forward.
    """

    def __init__(self, max_bytes: int) -> None:
        """``max_bytes`` bounds the storage kept alive by cached outputs."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(
                f"ExactProjectionCache: max_bytes={max_bytes!r} must be a non-negative int "
                "(bytes of projection outputs to keep); pass 0 to store nothing."
            )
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._hashed: dict[int, _Hashed] = {}
        self._stats = ProjectionCacheStats()
        self._bytes_held = 0

    @property
    def stats(self) -> ProjectionCacheStats:
        """A snapshot of the counters (mutating it does not affect the cache)."""
        snap = dataclasses.replace(self._stats, bypasses=dict(self._stats.bypasses))
        snap.bytes_held, snap.entries = self._bytes_held, len(self._entries)
        return snap

    def clear(self) -> None:
        """Drop every cached output and remembered conditioning key; counters are kept.

        Call on checkpoint or adapter loads, projection behaviour changes and model moves."""
        self._entries.clear()
        self._hashed.clear()
        self._bytes_held = 0

    def prepare(self, conditioning: Tensor) -> None:
        """Compute ``conditioning``'s key now, so the ``project()`` calls that follow find it.

        Call it once per conditioning tensor, before its projections: the hash (one host copy, a
        device sync) then happens here, once, at a point the caller chooses. A tensor already
        prepared, and not changed since, is not hashed again. Does nothing where every ``project()``
        steps aside whatever the projection: while compiling, during CUDA-graph capture, with
        gradients on, or with a global module hook."""
        if torch.compiler.is_compiling() or _call_bypass_reason() is not None:
            return  # no host sync in a trace or a capture, and no hash that no lookup would use
        self._key_for(conditioning, in_project=False)

    def project(
        self, name: str, projection: nn.Module, conditioning: Tensor, compute: Callable[[], Tensor],
        variant: Callable[[], Hashable] | None = None,
    ) -> Tensor:
        """Return ``compute()``'s output for ``projection`` applied to ``conditioning``.

        ``compute`` must depend only on ``conditioning``, the weights/buffers of ``projection``,
        fixed preprocessing and what ``variant()`` names (the adapters chosen for this call, whose
        content it identifies), and must return a freshly allocated tensor."""
        if torch.compiler.is_compiling():
            self._note_traced_bypass()  # a cached tensor would be baked into the graph
            return compute()
        reason = _symmetric_bypass_reason(projection)
        if reason is not None:
            self._count_bypass(reason)
            return compute()
        tensors = _tensors_of(projection)
        weights = _weights_signature(tensors)
        cond_key = self._key_for(conditioning, in_project=True)
        key = (name, cond_key, _numerics_signature(conditioning, tensors), None if variant is None else variant())
        entry = self._entries.get(key)
        if entry is not None and not _same_weights(entry, weights, tensors):
            self._drop(key)  # stale: the weights moved or were updated in place
            self._stats.invalidations += 1
            entry = None
        if entry is not None:
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return entry.output
        output = compute()
        if self._store(key, weights, tensors, output):
            self._stats.misses += 1
        else:
            self._count_bypass(TOO_LARGE)
        return output

    def drop_variants(self, depends: Callable[[Hashable], bool]) -> int:
        """Drop the entries whose variant `depends` on something going away (an unloaded adapter);
        returns how many. Entries of other variants stay."""
        stale = [key for key in self._entries if key[3] is not None and depends(key[3])]
        for key in stale:
            self._drop(key)
        self._stats.invalidations += len(stale)
        return len(stale)

    # -- internals ---------------------------------------------------------------------------

    def _count_bypass(self, reason: str) -> None:
        self._stats.bypasses[reason] = self._stats.bypasses.get(reason, 0) + 1

    # Run once at trace time, not replayed by compiled code: a counter traced as a side effect
    # would be guarded on its value and recompile the graph on every call.
    @torch.compiler.assume_constant_result
    def _note_traced_bypass(self) -> bool:
        self._count_bypass(COMPILING)
        return True

    def _remember(self, conditioning: Tensor, in_project: bool) -> ConditioningKey:
        """Hash `conditioning` (one host copy: a device sync) and remember the key for this tensor."""
        self._stats.hashes += 1
        if in_project:
            self._stats.unprepared_hashes += 1
        key = _hash_conditioning(conditioning)
        self._hashed = {k: p for k, p in self._hashed.items() if p.ref() is not None}
        storage, version = conditioning.untyped_storage(), _version_of(conditioning)
        self._hashed[id(conditioning)] = _Hashed(
            weakref.ref(conditioning), weakref.ref(storage), conditioning.data_ptr(), version, key
        )
        return key

    def _key_for(self, conditioning: Tensor, in_project: bool) -> ConditioningKey:
        # Identity alone is not enough: ids are reused after GC and a tensor can be mutated or
        # re-pointed, so the object, its storage, its address and its version must all match.
        p = self._hashed.get(id(conditioning))
        if (
            p is not None
            and p.ref() is conditioning
            and p.storage() is conditioning.untyped_storage()
            and p.data_ptr == conditioning.data_ptr()
            and p.version == _version_of(conditioning)
        ):
            return p.key
        return self._remember(conditioning, in_project)

    def _store(self, key: tuple, weights: tuple, tensors: list, output: Tensor) -> bool:
        """Store ``output`` under ``key``, evicting least recently used entries; False if it
        exceeds the whole budget."""
        if not isinstance(output, Tensor):
            raise TypeError(
                f"ExactProjectionCache: projection {key[0]!r} produced {type(output).__name__}; "
                "compute() must return a single Tensor (cache each tensor under its own name)."
            )
        self._drop(key)  # a recomputed value replaces any older one, even if it is not stored
        # A view keeps its whole storage alive, so that is what counts against the budget.
        nbytes = max(output.untyped_storage().nbytes(), output.numel() * output.element_size())
        if nbytes > self.max_bytes:
            return False
        while self._entries and self._bytes_held + nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes_held -= evicted.nbytes
            self._stats.evictions += 1
        storages = tuple(weakref.ref(t.untyped_storage()) for _, t in tensors)
        self._entries[key] = _Entry(weights, storages, output, nbytes)
        self._bytes_held += nbytes
        return True

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes_held -= entry.nbytes


def _call_bypass_reason() -> str | None:
    """Why no call may use the cache right now, whatever its projection, or None."""
    if _capturing_cuda_graph():
        return CUDA_GRAPH_CAPTURE  # hashing syncs, and a stored output would live in the graph pool
    if torch.is_grad_enabled():
        return GRAD_ENABLED  # a cached output has no autograd history for this forward
    if _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks:
        return GLOBAL_HOOKS  # hooks may observe or rewrite the call we would skip
    return None


def _symmetric_bypass_reason(projection: nn.Module) -> str | None:
    """Why the cache must not be used for this call, or None. Checked before any hashing."""
    reason = _call_bypass_reason()
    if reason is not None:
        return reason
    for module in projection.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return MODULE_HOOKS
    for _, tensor in _tensors_of(projection):
        if tensor.is_inference():
            return INFERENCE_WEIGHTS  # no version counter, so in-place updates are invisible
        if type(tensor) not in (Tensor, nn.Parameter):
            return SUBCLASS_WEIGHTS  # inner tensors (quantized, sharded) are not visible to us
    return None


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _tensors_of(projection: nn.Module) -> list[tuple[str, Tensor]]:
    return [*projection.named_parameters(), *projection.named_buffers()]


def _weights_signature(tensors: list[tuple[str, Tensor]]) -> tuple:
    """Identity, address, version and layout of every weight and buffer."""
    return tuple(
        (name, id(t), t.data_ptr(), t._version, t.dtype, str(t.device), tuple(t.shape), t.stride())
        for name, t in tensors
    )


def _same_weights(entry: _Entry, weights: tuple, tensors: list[tuple[str, Tensor]]) -> bool:
    """True if the weights still match ``entry``, including the very same storages."""
    if entry.weights != weights:
        return False
    return all(ref() is t.untyped_storage() for ref, (_, t) in zip(entry.storages, tensors))


def _numerics_signature(conditioning: Tensor, tensors: list[tuple[str, Tensor]]) -> tuple:
    """Autocast state for every device type involved, plus the global matmul precision flags."""
    device_types = {conditioning.device.type} | {t.device.type for _, t in tensors}
    autocast = tuple(
        (d, torch.is_autocast_enabled(d), _autocast_dtype(d)) for d in sorted(device_types)
    )
    backends = torch.backends
    mkldnn = getattr(backends, "mkldnn", None)
    return autocast + (
        torch.get_float32_matmul_precision(),
        backends.cuda.matmul.allow_tf32,
        backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        backends.cudnn.allow_tf32,
        # Newer precision knobs (absent on older torch); mkldnn's can make CPU fp32 matmul bf16.
        getattr(backends, "fp32_precision", None),
        getattr(backends.cuda.matmul, "fp32_precision", None),
        getattr(mkldnn, "fp32_precision", None),
        getattr(getattr(mkldnn, "matmul", None), "fp32_precision", None),
    )


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # device types without autocast support (e.g. "meta")
        return None


def _version_of(tensor: Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def _hash_conditioning(conditioning: Tensor) -> ConditioningKey:
    """Digest of the tensor's values (via a contiguous host copy) and its layout."""
    if conditioning.layout != torch.strided or type(conditioning) not in (Tensor, nn.Parameter):
        raise ValueError(
            f"ExactProjectionCache: conditioning of type {type(conditioning).__name__} with layout "
            f"{conditioning.layout} is not supported; only plain dense tensors can be hashed — "
            "pass a plain torch.strided tensor or call compute() without the cache."
        )
    host = conditioning.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.blake2b(host.numpy(), digest_size=16).hexdigest()
    shape, stride = tuple(conditioning.shape), tuple(conditioning.stride())
    return ConditioningKey(digest, conditioning.dtype, shape, stride, str(conditioning.device))
