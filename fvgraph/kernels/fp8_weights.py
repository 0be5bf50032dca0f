"""FP8 weights beside the originals: what the quantize pass (passes/quantize.py) swaps a linear onto.

    quantized = apply_fp8_weights(components.transformer, card.quantization.fp8_exclude)

Every eligible `nn.Linear` gets two NON-persistent buffers, quantized once here:

    <name>.fp8_weight  [N, K] float8_e4m3fn    per-output-channel quantized weight
    <name>.fp8_scale   [N]    float32          its scales (weight ~= fp8_weight * fp8_scale[:, None])

The original weight stays: eager runs, parity references and the request prologue (which the
quantize pass leaves in full precision) use it. Buffers are captured as graph placeholders, named by
`step_parameters`, which is how the pass finds them. Non-persistent, they never reach a state_dict,
a checkpoint or the weights-version hash; the pass pipeline's uuid says whether they are used.

Eligible: K and N are multiples of 16 (`torch._scaled_mm`'s rule on CUDA, applied on every device so
a card quantizes the same layers everywhere) and the module name matches no `exclude` pattern
(fnmatch over `named_modules()` names, e.g. "blocks.0.*").

Call it after the module's final dtype cast: `module.to(dtype)` casts float8 buffers too (they are
floating point), which the quantize pass refuses by name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn

from fvgraph.kernels.fp8_linear import fp8_linear_supported, quantize_weight_fp8

log = logging.getLogger(__name__)

FP8_WEIGHT = "fp8_weight"
FP8_SCALE = "fp8_scale"


def apply_fp8_weights(module: nn.Module, exclude: Sequence[str]) -> list[str]:
    """Quantize every eligible Linear of `module` (see the module docstring); returns their names.

    Idempotent: a second call with the same `exclude` re-derives the same buffers from the same
    weights; a Linear that is excluded now but was quantized before loses its buffers. A pattern
    that matches no module at all is an error (a typo would silently quantize the layers it meant to
    protect).
    """
    names = [name for name, _ in module.named_modules()]
    _check_patterns(exclude, names, type(module).__name__)
    quantized = []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        if _excluded(name, exclude) or not fp8_linear_supported(sub.weight):
            _drop_fp8(sub)
            continue
        with torch.no_grad():
            weight, scale = quantize_weight_fp8(sub.weight)
        sub.register_buffer(FP8_WEIGHT, weight, persistent=False)
        sub.register_buffer(FP8_SCALE, scale, persistent=False)
        quantized.append(name)
    log.info("fp8 weights: %d linears quantized, exclude=%s", len(quantized), list(exclude))
    return quantized


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in exclude)


def _check_patterns(exclude: Sequence[str], names: list[str], owner: str) -> None:
    if isinstance(exclude, str):
        raise TypeError(f"exclude={exclude!r} must be a sequence of fnmatch patterns, not one string")
    for pattern in exclude:
        if not any(fnmatchcase(name, pattern) for name in names):
            examples = ", ".join(repr(n) for n in names[1:6])
            raise ValueError(
                f"fp8_exclude pattern {pattern!r} matches no module of {owner}; patterns are fnmatch over "
                f"module names such as {examples}"
            )


def _drop_fp8(linear: nn.Linear) -> None:
    for buffer in (FP8_WEIGHT, FP8_SCALE):
        if hasattr(linear, buffer):
            delattr(linear, buffer)
