"""Wan text-to-video's projection-cache layout: its request-constant projections routed through a cache.

    cache = ExactProjectionCache(max_bytes=512 * 1024**2)     # fvgraph/runtime/projection_cache.py
    apply_projection_cache(transformer, cache)   # from outside: no diffusers code is changed
    ...                                          # run requests; K/V of the prompt are computed once
    remove_projection_cache(transformer)

What is request-constant in WanTransformer3DModel (diffusers' transformer_wan.py), for T2V configs:

    encoder_hidden_states --condition_embedder.text_embedder--> ctx       (PixArtAlphaTextProjection)
    ctx --blocks[i].attn2.to_k--> k --attn2.norm_k--> k'                  (WanAttnProcessor, unfused)
    ctx --blocks[i].attn2.to_v--> v

`ctx`, `k` and `v` are pure functions of the prompt embeddings and the weights, so they are cached
under the module's qualified name ("condition_embedder.text_embedder", "blocks.3.attn2.to_k", ...).
`norm_k` is left to run: it is a cheap elementwise RMSNorm whose module is shared by nothing else,
and caching it would only add a lookup per block. Everything that sees the latents or the timestep
(`to_q`, self-attention, FFN, modulation) is untouched.

How: each projection keeps its place and its parameters; only its `forward` is rebound as an instance
attribute (`module.forward = _CachedForward(...)`), which `nn.Module.__call__` picks up. That keeps
`transformer.state_dict()` keys and tensors identical (a wrapper module holding the original as a
child would prefix every key), adds no hooks (the cache steps aside for modules with hooks), patches
no diffusers class (other instances are unaffected), and traces cleanly: under torch.compile the
cache bypasses itself and Dynamo inlines the original forward, so a fullgraph trace has no breaks.

Preparing: a denoiser call has two conditionings, the prompt embeddings and `ctx`, and the text
embedder's forward is where both enter, once per call (the whole forward and Wan's sections in
fvgraph/models/wan_sections.py alike). So that forward calls `cache.prepare` on each before the
projections that read it: on the prompt embeddings before projecting them, and on `ctx` as soon as it
exists, before any block's K/V. The cache remembers each prepared tensor's key (checked by identity,
storage, address and version), so a conditioning is hashed once per tensor object: on a text_embedder
hit the very same `ctx` comes back every step and its prepare finds the key it already has.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from diffusers import WanTransformer3DModel
from torch import Tensor, nn

from fvgraph.adapters.slots import slot_store
from fvgraph.models.projection_cache_protocol import ProjectionCache

TEXT_EMBEDDER = "condition_embedder.text_embedder"
CROSS_ATTENTION_KV = ("to_k", "to_v")


class _CachedForward:
    """A projection's forward routed through the cache; installed as the module's instance `forward`.

    Holds the module weakly so the module -> forward -> module cycle cannot delay freeing the model;
    `previous` is an instance-level forward that was already installed (by another tool), if any.
    With `prepares` (the text embedder) it prepares its input before projecting it and its output,
    the input of every cross-attention K/V, before returning it."""

    def __init__(
        self, cache: ProjectionCache, name: str, module: nn.Module, variant=None, prepares: bool = False
    ) -> None:
        self.projection_cache = cache
        self.name = name
        self.variant = variant  # the adapters this call runs with (SlotStore.cache_variant), or None
        self.prepares = prepares
        self.previous = module.__dict__.get("forward")
        self._module = weakref.ref(module)
        self._class_forward = type(module).forward

    def __call__(self, conditioning: Tensor) -> Tensor:
        module = self._module()
        if self.prepares:
            self.projection_cache.prepare(conditioning)
        output = self.projection_cache.project(self.name, module, conditioning, lambda: self.original(module, conditioning), self.variant)
        if self.prepares:
            self.projection_cache.prepare(output)
        return output

    def original(self, module: nn.Module, conditioning: Tensor) -> Tensor:
        if self.previous is not None:
            return self.previous(conditioning)
        return self._class_forward(module, conditioning)


def apply_projection_cache(transformer: WanTransformer3DModel, cache: ProjectionCache) -> None:
    """Route `transformer`'s text embedding and every cross-attention K/V projection through `cache`.

    Use one cache per transformer. Call `cache.clear()` after loading weights into it; adapter slots
    (fvgraph/adapters/slots.py) installed before this call key each entry by the adapters of its rows."""
    _check_supported(transformer)
    store = slot_store(transformer)  # with adapter slots, each entry is also keyed by the rows' adapters
    variant = None if store is None else store.cache_variant
    for name, module in request_constant_projections(transformer):
        module.forward = _CachedForward(cache, name, module, variant, prepares=name == TEXT_EMBEDDER)


def remove_projection_cache(transformer: nn.Module) -> None:
    """Restore the forward each projection had before `apply_projection_cache` (the cache is kept)."""
    for module in transformer.modules():
        installed = module.__dict__.get("forward")
        if not isinstance(installed, _CachedForward):
            continue
        if installed.previous is None:
            del module.forward
        else:
            module.forward = installed.previous


def request_constant_projections(transformer: WanTransformer3DModel) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) of every projection whose input is constant for one request."""
    yield TEXT_EMBEDDER, transformer.condition_embedder.text_embedder
    for i, block in enumerate(transformer.blocks):
        for attr in CROSS_ATTENTION_KV:
            yield f"blocks.{i}.attn2.{attr}", getattr(block.attn2, attr)


def _check_supported(transformer: nn.Module) -> None:
    if not isinstance(transformer, WanTransformer3DModel):
        raise TypeError(
            f"apply_projection_cache: transformer is a {type(transformer).__name__}; this adapter knows "
            "diffusers.WanTransformer3DModel only — write an adapter for other models."
        )
    if transformer.condition_embedder.image_embedder is not None or transformer.config.added_kv_proj_dim is not None:
        raise ValueError(
            "apply_projection_cache: image_dim/added_kv_proj_dim are set (an I2V config); only text-to-video "
            "Wan is supported: there the cross-attention input is a fresh slice of a per-step concat, "
            "which would be rehashed (a host sync) at every step. Use the T2V config or no cache."
        )
    for i, block in enumerate(transformer.blocks):
        if block.attn2.fused_projections:
            raise ValueError(
                f"apply_projection_cache: blocks.{i}.attn2 has fused projections (to_kv), which the "
                "cache does not cover; call transformer.unfuse_qkv_projections() before applying it."
            )
    already = [
        name
        for name, module in request_constant_projections(transformer)
        if isinstance(module.__dict__.get("forward"), _CachedForward)
    ]
    if already:
        raise ValueError(
            f"apply_projection_cache: {already[0]} (and {len(already) - 1} more) already route through a "
            "projection cache; call remove_projection_cache(transformer) before applying another."
        )
