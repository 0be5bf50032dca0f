"""What the image loops' denoise steps share (FLUX, Qwen-Image): a `denoiser` submodule called once
per CFG branch between branch markers (both as one call when traced with CFG fusion), the adapter
rows it passes on to the transformer, the joint attention's shape, and the tap outputs of a parity run."""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.contract.cfg_branches import call_branches
from fvgraph.contract.markers import mark_request_constant
from fvgraph.loops.samplers import FlowEulerSampler
from fvgraph.loops.taps import TapPoints
from fvgraph.models.flux_sections import packed_attention_shape


class ImageDenoiseStep(nn.Module):
    """Base of an image loop's denoise step: `denoiser` wraps the family's transformer (every argument
    batched), then the sampler, whether the step runs true CFG, and the parity taps."""

    def __init__(self, denoiser: nn.Module, sampler: FlowEulerSampler, cfg: bool, vae_spatial: int,
                 tap_points: TapPoints | None = None):  # fmt: skip
        super().__init__()
        self.denoiser = denoiser
        self.sampler = sampler
        self.cfg = cfg
        self.vae_spatial = vae_spatial
        self.tap_points = tap_points  # parity runs only: block outputs as "tap.*" outputs
        self.cfg_split = None  # no CFG-parallel plan for the image loops
        self.fuse_branches = False  # CFG fusion (passes/cfg_fusion.py) sets it while the step is traced

    def branches(self, cond: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cond noise, uncond noise or None): the denoiser on each branch's keyword inputs, marked as
        CFG branches (markers vanish in eager), fused into one call while the step is traced with CFG
        fusion (fvgraph/contract/cfg_branches.py)."""
        calls = {"cond": cond, **({} if uncond is None else {"uncond": uncond})}
        outputs = call_branches("denoiser", self._denoiser, calls, self.fuse_branches)
        return outputs["cond"][0], outputs["uncond"][0] if uncond is not None else None

    def _denoiser(self, **inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.denoiser(**inputs, return_dict=False)[0],)

    @staticmethod
    def adapter_rows(lora_index: torch.Tensor | None, lora_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Each row's adapter slots and scales ([B, K], fvgraph/adapters/slots.py) as arguments of a
        branch's call: fused and hoisted like the text; none on an engine without adapter slots."""
        if lora_index is None:
            return {}
        return {"lora_index": mark_request_constant(lora_index), "lora_scale": mark_request_constant(lora_scale)}

    def with_taps(self, out: dict[str, torch.Tensor], taps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A parity variant's step also returns its predictions and block outputs as "tap.*"."""
        if self.tap_points is not None:
            out.update(taps)
            out.update(self.tap_points.drain())
        return out

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        """(tokens, head_dim, dtype) of the joint attention: text plus packed image tokens."""
        return packed_attention_shape(self.denoiser.transformer, inputs)
