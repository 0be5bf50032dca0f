"""What the image loops' denoise steps share (FLUX, Qwen-Image): a `denoiser` submodule called once
per CFG branch between branch markers (so the CFG-fusion pass runs both as one call), the adapter
rows it passes on to the transformer, the joint attention's shape, and the tap outputs of a parity run."""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.contract.markers import mark_branch_inputs, mark_branch_output, mark_request_constant
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

    def branch(self, branch: str, **inputs: torch.Tensor) -> torch.Tensor:
        """One denoiser call on `branch` ("cond" / "uncond"), marked for the fusion pass (markers vanish in eager)."""
        marked = dict(zip(inputs, mark_branch_inputs(branch, "denoiser", **inputs)))
        return mark_branch_output(branch, "denoiser", self.denoiser(**marked, return_dict=False)[0])

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
