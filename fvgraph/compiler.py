"""StepCompiler: WorkPlan -> StepSignature -> captured graph -> passes -> backend -> CompiledStep.

One artifact per signature, built the first time a plan with that signature runs (or at warmup).
Compiled steps are called directly with their flat arguments, keyed by signature, with no dynamo
guards on the serving path: the signature *is* the guard, and a frozen compiler refuses to build a
new one (the engine's `fail_on_recompile` stance), naming the factors that differ.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from fvgraph.counters import Counters
from fvgraph.loop import WorkPlan
from fvgraph.signature import RuntimeFactors, StepSignature
from fvgraph.step_capture import capture_step, step_parameters
from fvgraph.passes.base import PassContext
from fvgraph.passes.manager import PassConfig, PassManager

log = logging.getLogger(__name__)

Backend = Literal["eager", "aot_eager", "inductor"]

# Inductor settings, each with its reason, in one place.
INDUCTOR_CONFIG = {
    # fvgraph captures CUDA graphs itself (static buffers, one pool, bucketed); inductor's own
    # cudagraph trees would capture a second time underneath.
    "triton.cudagraphs": False,
}


class RecompileError(RuntimeError):
    """A new signature showed up after warmup, while serving under fail_on_recompile."""


@dataclass(frozen=True)
class CompileConfig:
    backend: Backend = "inductor"
    mode: str = "default"
    passes: PassConfig = field(default_factory=PassConfig)
    # The denoise step runs N times per request, so that is where compiling pays; text encode and VAE
    # decode run once each. None compiles every step kind.
    step_kinds: tuple[str, ...] | None = ("denoise", "denoise_cfg")


@dataclass
class CompiledStep:
    signature: StepSignature
    step_fn: object
    prologue_fn: object | None
    params: list[torch.Tensor]
    input_names: list[str]
    output_names: list[str]
    passes_changed: dict[str, int]
    compile_seconds: float
    # The prologue's outputs as meta tensors: their shapes and strides are what the step was compiled
    # for (inductor asserts input strides), so static buffers copy them.
    hoisted_like: list[torch.Tensor] = field(default_factory=list)


STEP_COMPONENT = {"text_encode": "text_encoder", "denoise": "transformer", "denoise_cfg": "transformer", "vae_decode": "vae"}


class StepCompiler:
    def __init__(self, config: CompileConfig, card_id: str, weights_version: str, loop_id: str, precision: str,
                 device: torch.device, counters: Counters):  # fmt: skip
        self.config = config
        self.pass_manager = PassManager(config.passes)
        self.counters = counters
        self.frozen = False
        self._base = dict(card_id=card_id, weights_version=weights_version, loop=loop_id, precision=precision)
        self._runtime = RuntimeFactors.current(device)
        self._compiled: dict[StepSignature, CompiledStep] = {}

    def wants(self, kind: str) -> bool:
        return self.config.step_kinds is None or kind in self.config.step_kinds

    def signature(self, plan: WorkPlan, batch: int = 1) -> StepSignature:
        return StepSignature(
            component=STEP_COMPONENT.get(plan.kind, plan.kind), step_kind=plan.kind, shape=plan.signature,
            batch=batch, pass_pipeline=self.pass_manager.uuid(), backend=self.config.backend,
            mode=self.config.mode, runtime=self._runtime, **self._base,
        )  # fmt: skip

    def get(self, step: nn.Module, plan: WorkPlan, batch: int = 1) -> CompiledStep:
        """The compiled step for `plan`'s signature at `batch` (plan inputs already have that batch)."""
        signature = self.signature(plan, batch)
        compiled = self._compiled.get(signature)
        if compiled is None:
            if self.frozen:
                raise RecompileError(self._refusal(signature))
            compiled = self._compiled[signature] = self._build(step, plan, signature)
        return compiled

    @property
    def signatures(self) -> list[StepSignature]:
        return list(self._compiled)

    def _build(self, step: nn.Module, plan: WorkPlan, signature: StepSignature) -> CompiledStep:
        began = time.perf_counter()
        captured = capture_step(plan.kind, step, plan.inputs)
        ctx = PassContext(root=step, example_args=captured.example_args, num_params=captured.num_params)
        gm = self.pass_manager(captured.gm, ctx)
        prologue_fn, step_args, hoisted = None, list(captured.example_args), []
        if ctx.prologue is not None:
            prologue_fn = self._backend_compile(ctx.prologue, step_args)
            with torch.no_grad():
                hoisted = list(ctx.prologue(*step_args))
            step_args += hoisted
        step_fn = self._backend_compile(gm, step_args)
        seconds = time.perf_counter() - began
        self.counters.compiles += 1
        self.counters.compile_seconds += seconds
        log.info("compiled %s in %.1f s (passes changed %s)\n%s", plan.kind, seconds, ctx.changed, signature)
        return CompiledStep(
            signature, step_fn, prologue_fn, list(step_parameters(step).values()), captured.input_names,
            captured.output_names + ctx.extra_outputs, dict(ctx.changed), seconds, [t.to("meta") for t in hoisted],
        )  # fmt: skip

    def _backend_compile(self, gm: torch.fx.GraphModule, example_args: list[torch.Tensor]):
        backend = self.config.backend
        if backend == "eager":
            return gm
        if backend == "aot_eager":
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_args)
        from torch._inductor.compile_fx import compile_fx

        patches = dict(INDUCTOR_CONFIG)
        if self.pass_manager.inductor:
            patches["post_grad_custom_post_pass"] = self.pass_manager.inductor
        if self.config.mode != "default":
            patches.update(torch._inductor.list_mode_options(self.config.mode))
        with torch.no_grad():
            return compile_fx(gm, example_args, config_patches=patches)

    def _refusal(self, signature: StepSignature) -> str:
        same_kind = [s for s in self._compiled if s.step_kind == signature.step_kind] or list(self._compiled)
        lines = [f"no compiled graph for a new signature after warmup (fail_on_recompile):\n{signature}"]
        if same_kind:
            nearest = min(same_kind, key=lambda s: len(signature.diff(s)))
            lines.append("differs from the nearest warm signature in: " + "; ".join(signature.diff(nearest)))
        return "\n".join(lines)
