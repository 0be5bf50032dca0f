"""The pass manager: an ordered list of FX passes chosen by name, plus the fixed cleanup tail and,
last, the finite flags every compiled step returns for the runner's NaN check.

Its uuid covers the source of every enabled pass, the inductor-level bundle, and the config; it is a
factor of the CompileCache signature, so changing or disabling a pass can never reuse an artifact
built without that change.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass

from torch import fx, nn

from fvgraph.passes.base import FxPass, PassContext
from fvgraph.passes.cfg_fusion import CfgFusionPass
from fvgraph.passes.cleanup import CleanupPass
from fvgraph.passes.finite_flags import FiniteFlagsPass
from fvgraph.passes.hoist_invariants import HoistInvariantsPass
from fvgraph.passes.quantize import QuantizePass
from fvgraph.passes.tap_outputs import TapOutputsPass

log = logging.getLogger(__name__)

# Every FX pass, in the order it runs. Fusion first, so hoisting sees one batched text projection
# instead of two; quantization after hoisting, so the prologue's linears (run once per request) stay
# in full precision and only the per-step GEMMs go FP8.
FX_PASSES: dict[str, type[FxPass]] = {
    "cfg_fusion": CfgFusionPass,
    "hoist_invariants": HoistInvariantsPass,
    "quantize": QuantizePass,
}
# Passes that change numerics beyond the parity tolerance of the model's own precision: they run only
# when a config names them in `enabled` (opt level 3 enables "quantize").
OPT_IN: frozenset[str] = frozenset({"quantize"})


@dataclass(frozen=True)
class PassConfig:
    """Which passes run: every pass of FX_PASSES that is on by default or `enabled`, unless `disabled`.

    One list of names each way rather than one boolean per pass: FX_PASSES stays the single ordered
    registry, `enabled` turns on opt-in passes (OPT_IN, e.g. opt level 3's "quantize"), and `disabled`
    (the CLI's --disable-pass) turns any pass off and wins over `enabled`, so `-O3 --disable-pass
    quantize` is -O3 without FP8. The config is part of the pipeline uuid, and with it of every signature.
    """

    disabled: tuple[str, ...] = ()
    enabled: tuple[str, ...] = ()  # opt-in passes (names from OPT_IN) to run
    taps: bool = False  # parity runs: turn tap markers into extra outputs (its own pipeline uuid)

    def __post_init__(self) -> None:
        unknown = set(self.disabled) - set(FX_PASSES)
        if unknown:
            raise ValueError(f"disable-pass: unknown pass {sorted(unknown)}; known passes: {sorted(FX_PASSES)}")
        not_opt_in = set(self.enabled) - OPT_IN
        if not_opt_in:
            raise ValueError(
                f"enabled={sorted(not_opt_in)}: only opt-in passes {sorted(OPT_IN)} are enabled by name; "
                f"the others ({sorted(set(FX_PASSES) - OPT_IN)}) run by default"
            )

    def runs(self, name: str) -> bool:
        """Whether pass `name` is in the pipeline (e.g. whether to apply FP8 weights for "quantize")."""
        on = name not in OPT_IN or name in self.enabled
        return name in FX_PASSES and on and name not in self.disabled


class PassManager:
    def __init__(self, config: PassConfig = PassConfig()):
        self.config = config
        self.passes = [cls() for name, cls in FX_PASSES.items() if config.runs(name)]
        if config.taps:
            self.passes.append(TapOutputsPass())
        self.tail = [CleanupPass()]
        self.last = FiniteFlagsPass()  # on the step graph only, once the graph is final
        self._uuid = self._compute_uuid()  # read on every step's signature: compute once

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        for fx_pass in self.passes:
            gm = fx_pass(gm, ctx)
        for fx_pass in self.tail:  # the tail cleans the prologue a hoisting pass split off, too
            gm = fx_pass(gm, ctx)
            if ctx.prologue is not None:
                ctx.prologue = fx_pass(ctx.prologue, ctx)
        gm = self.last(gm, ctx)
        log.debug("passes changed nodes: %s", ctx.changed)
        return gm

    @contextlib.contextmanager
    def tracing(self, step: nn.Module):
        """Hold what each pass sets on `step` while it is traced (`FxPass.tracing`)."""
        with contextlib.ExitStack() as stack:
            for fx_pass in self.passes:
                stack.enter_context(fx_pass.tracing(step))
            yield

    def uuid(self) -> str:
        return self._uuid

    def _compute_uuid(self) -> str:
        parts = [p.name + ":" + p.uuid() for p in (*self.passes, *self.tail, self.last)]
        parts += [f"config:{self.config}"]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
