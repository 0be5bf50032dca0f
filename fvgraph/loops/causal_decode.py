"""A causal video VAE's decode as one step per latent frame, so its frames come out as they are made.

Wan's VAE (AutoencoderKLWan) decodes causally: diffusers' `_decode` runs its decoder on one latent
frame at a time (the first gives 1 frame, each later one `vae_temporal` frames), carrying a cache of
each causal conv's last input frames from one call to the next, and concatenates the pieces. Here each
of those calls is a `vae_decode_chunk` step, and the conv cache travels as the step's CARRIED tensors,
so the step holds nothing between calls and other requests' steps run in between. A chunk's pixels are
final once its step returns (what follows in diffusers, unpatchify and the clamp, and the [0, 1]
postprocess, act on each frame alone), so the loop hands them on as they come (`DecodedFrames`) and
the whole decode is their concatenation: bit-identical to the single `vae_decode` step.

A decode with `vae_tiling` runs as tiles (fvgraph/loops/tiled_coding.py), each tile through every
frame; its frames are final only after the last tile, so they come out together at its end.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from fvgraph.contract.step_kind import Role, StepKind

VAE_DECODE_CHUNK = "vae_decode_chunk"
# The kinds of a cache entry, as diffusers' list holds them: unset, its temporal upsampler's "Rep"
# marker (first chunk only), or a tensor (a later input `cache_<i>`).
_UNSET, _REP, _TENSOR = 0, 1, 2


def is_causal_video_vae(vae: nn.Module | None) -> bool:
    """Whether `vae` decodes frame by frame with a conv cache that a step can carry (Wan's VAEs)."""
    if vae is None or not hasattr(vae, "_cached_conv_counts"):
        return False
    return "first_chunk" in inspect.signature(vae.decoder.forward).parameters


def chunk_kind(vae: nn.Module) -> StepKind:
    """The step kind of one chunk for `vae`: its conv cache entries are named inputs and outputs."""
    cache = {f"cache_{i}": Role.CARRIED for i in range(vae._cached_conv_counts["decoder"])}
    return StepKind(VAE_DECODE_CHUNK, component="vae", phase="vae_decode",
                    inputs={"latents": Role.STEP, "cache_kinds": Role.CARRIED, **cache},
                    outputs={"frames": Role.RESULT, "cache_kinds": Role.CARRIED, **cache})  # fmt: skip


class ChunkDecodeStep(nn.Module):
    """One latent frame [1, C, 1, h, w] (normalized) and the conv cache after the previous ones ->
    its frames in [0, 1] [1, 3, t, H, W] and the cache after it. No cache given: the first chunk."""

    def __init__(self, decode_step: nn.Module):
        super().__init__()
        self.decode_step = decode_step  # the whole-decode step (steps.VaeDecodeStep): its denormalize and postprocess
        self.vae = decode_step.vae

    def forward(self, latents: torch.Tensor, cache_kinds: torch.Tensor | None = None, **cache: torch.Tensor) -> dict[str, torch.Tensor]:
        vae = self.vae
        first = cache_kinds is None
        if first:
            feat_cache: list = [None] * vae._cached_conv_counts["decoder"]
        else:
            feat_cache = [_entry(int(k), cache.get(f"cache_{i}")) for i, k in enumerate(cache_kinds[0].tolist())]
        x = vae.post_quant_conv(self.decode_step.vae_latents(latents))
        out = vae.decoder(x, feat_cache=feat_cache, feat_idx=[0], first_chunk=first)
        if vae.config.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=vae.config.patch_size)
        frames = self.decode_step.postprocess(torch.clamp(out, min=-1.0, max=1.0))
        kinds = [_UNSET if e is None else _REP if isinstance(e, str) else _TENSOR for e in feat_cache]
        result = {"frames": frames, "cache_kinds": torch.tensor([kinds], dtype=torch.int8)}
        result.update({f"cache_{i}": e for i, e in enumerate(feat_cache) if isinstance(e, torch.Tensor)})
        return result


def _entry(kind: int, tensor: torch.Tensor | None):
    if kind == _TENSOR:
        if tensor is None:
            raise ValueError("a conv cache entry marked as a tensor came without its tensor")
        return tensor
    return "Rep" if kind == _REP else None


class ChunkedDecode:
    """One request's chunked decode so far: which latent frame is next, the carried cache, the pixels."""

    def __init__(self):
        self.index = 0  # the next latent frame
        self.cache: dict[str, torch.Tensor] = {}  # the last chunk's cache outputs (cache_kinds, cache_<i>)
        self.chunks: list[torch.Tensor] = []  # [1, 3, t, H, W] in [0, 1] each, in order
        self.frames_done = 0  # pixel frames decoded so far

    def inputs(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"latents": latents[:, :, self.index : self.index + 1], **self.cache}

    def take(self, result: dict[str, torch.Tensor]) -> torch.Tensor:
        """Fold one chunk's result in; returns its frames."""
        frames = result["frames"]
        self.cache = {name: t for name, t in result.items() if name != "frames"}
        self.chunks.append(frames)
        self.index += 1
        self.frames_done += frames.shape[2]
        return frames

    def finished(self, latents: torch.Tensor) -> bool:
        return self.index == latents.shape[2]

    def whole(self) -> torch.Tensor:
        """The decoded video, [1, 3, F, H, W] in [0, 1]: the chunks in order."""
        return torch.cat(self.chunks, dim=2)
