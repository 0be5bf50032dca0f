"""The pass manager: an ordered list of FX passes chosen by name, plus the fixed cleanup tail.

Its uuid covers the source of every enabled pass, the inductor-level bundle, and the config; it is a
factor of the CompileCache signature, so changing or disabling a pass can never reuse an artifact
built without that change.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from torch import fx

from fvgraph.passes.base import FxPass, PassContext
from fvgraph.passes.cfg_fusion import CfgFusionPass
from fvgraph.passes.cleanup import CleanupPass
from fvgraph.passes.hoist_invariants import HoistInvariantsPass
from fvgraph.passes.inductor_bundle import InductorPassBundle
from fvgraph.passes.tap_outputs import TapOutputsPass

log = logging.getLogger(__name__)

# Order matters: fusion first, so hoisting sees one batched text projection instead of two.
FX_PASSES: dict[str, type[FxPass]] = {"cfg_fusion": CfgFusionPass, "hoist_invariants": HoistInvariantsPass}


@dataclass(frozen=True)
class PassConfig:
    """Which passes run. `disabled` names passes from FX_PASSES to skip (the CLI's --disable-pass)."""

    disabled: tuple[str, ...] = ()
    taps: bool = False  # parity runs: turn tap markers into extra outputs (its own pipeline uuid)

    def __post_init__(self) -> None:
        unknown = set(self.disabled) - set(FX_PASSES)
        if unknown:
            raise ValueError(f"disable-pass: unknown pass {sorted(unknown)}; known passes: {sorted(FX_PASSES)}")


class PassManager:
    def __init__(self, config: PassConfig = PassConfig(), inductor: InductorPassBundle | None = None):
        self.config = config
        self.passes = [cls() for name, cls in FX_PASSES.items() if name not in config.disabled]
        if config.taps:
            self.passes.append(TapOutputsPass())
        self.tail = [CleanupPass()]
        self.inductor = inductor or InductorPassBundle()
        self._uuid = self._compute_uuid()  # read on every step's signature: compute once

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        for fx_pass in self.passes:
            gm = fx_pass(gm, ctx)
        for fx_pass in self.tail:  # the tail cleans the prologue a hoisting pass split off, too
            gm = fx_pass(gm, ctx)
            if ctx.prologue is not None:
                ctx.prologue = fx_pass(ctx.prologue, ctx)
        log.debug("passes changed nodes: %s", ctx.changed)
        return gm

    def uuid(self) -> str:
        return self._uuid

    def _compute_uuid(self) -> str:
        parts = [p.name + ":" + p.uuid() for p in (*self.passes, *self.tail)]
        parts += [f"inductor:{self.inductor.uuid()}", f"config:{self.config}"]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
