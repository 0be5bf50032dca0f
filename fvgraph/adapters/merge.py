"""Merged adapters: a LoRA fused into the denoiser's own weights once, at load, for a deployment that
serves one adapter set to every request.

    suffix = merge_lora(transformer, lora, scale=0.7)   # W += 0.7 * scaling * up @ down (in fp32)
    components.weights_version += suffix                 # other weights: other signatures, other capture-cache keys

A merged step costs what the base step costs (no slot GEMMs). The weights are changed for good in
this engine: a merged adapter is never unloaded; build another engine for another set.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from fvgraph.adapters.lora_file import LoraWeights


@torch.no_grad()
def merge_lora(transformer: nn.Module, lora: LoraWeights, scale: float) -> str:
    """Fuse `lora` at `scale` into `transformer`'s linears; returns a weights-version suffix naming it."""
    for name, module in lora.modules.items():
        linear = transformer.get_submodule(name)
        weight = linear.weight
        delta = (scale * module.scaling) * (module.up @ module.down)  # [out, in] in fp32
        weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
        if module.up_bias is not None:
            if linear.bias is None:
                raise ValueError(f"merge: lora key transformer.{name}.lora_B.bias adds a bias to a linear without one")
            bias = linear.bias
            bias.copy_((bias.float() + (scale * module.scaling) * module.up_bias.to(bias.device)).to(bias.dtype))
    return f"+lora:{hashlib.sha256(f'{lora.digest}@{scale!r}'.encode()).hexdigest()[:12]}"
