"""Executors: run a WorkPlan's step function, eagerly or through its compiled graph.

The eager executor is the reference every faster path is checked against, and the fallback when a
faster path is unavailable. Both run each plan on its own (batch 1), so numerics never depend on
which other requests happen to be in flight.
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.compiler import StepCompiler
from fvgraph.counters import Counters
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
    def __init__(self, steps: dict[str, nn.Module], counters: Counters):
        self.steps = steps
        self.counters = counters

    def run(self, plan: WorkPlan) -> StepResult:
        step = self.steps.get(plan.kind)
        if step is None:
            raise KeyError(f"no step function for kind {plan.kind!r}; known: {sorted(self.steps)}")
        self.counters.eager_steps += 1
        with torch.no_grad():
            return step(**plan.inputs)


class CompiledExecutor:
    """Runs the step kinds the compiler covers through compiled graphs, the rest eagerly."""

    def __init__(self, eager: EagerExecutor, compiler: StepCompiler):
        self.eager = eager
        self.steps = eager.steps
        self.compiler = compiler
        self.counters = eager.counters

    def run(self, plan: WorkPlan) -> StepResult:
        if not self.compiler.wants(plan.kind):
            return self.eager.run(plan)
        compiled = self.compiler.get(self.steps[plan.kind], plan)
        stance = "fail_on_recompile" if self.compiler.frozen else "default"
        with torch.no_grad(), torch.compiler.set_stance(stance):
            result = compiled(plan.inputs, plan.request_cache, self.counters)
        self.counters.compiled_steps += 1
        return result
