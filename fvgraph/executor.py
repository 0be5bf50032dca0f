"""The eager executor: runs a WorkPlan's step function as plain PyTorch.

This is the reference every faster path is checked against, and the fallback when a faster path is
unavailable for a signature. It runs each plan on its own (batch 1), so its numerics never depend on
which other requests happen to be in flight.
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.loop import StepResult, WorkPlan
from fvgraph.steps import DenoiseStep, TextEncodeStep, VaeDecodeStep
from fvgraph.t2v_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE, VAE_DECODE, TextToVideoLoop


def build_steps(loop: TextToVideoLoop) -> dict[str, nn.Module]:
    """One step module per step kind; they share the loop's component modules (no weight copies)."""
    c = loop.components
    steps = {
        TEXT_ENCODE: TextEncodeStep(c.text_encoder),
        DENOISE: DenoiseStep(c.transformer, loop.sampler, cfg=False),
        DENOISE_CFG: DenoiseStep(c.transformer, loop.sampler, cfg=True),
        VAE_DECODE: VaeDecodeStep(c.vae),
    }
    return {kind: step.to(c.device).eval() for kind, step in steps.items()}


class EagerExecutor:
    def __init__(self, steps: dict[str, nn.Module]):
        self.steps = steps

    def run(self, plan: WorkPlan) -> StepResult:
        step = self.steps.get(plan.kind)
        if step is None:
            raise KeyError(f"no step function for kind {plan.kind!r}; known: {sorted(self.steps)}")
        with torch.no_grad():
            return step(**plan.inputs)
