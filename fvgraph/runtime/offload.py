"""Offload: which weights an engine keeps on its device, chosen by `Engine.from_card(offload=...)`, and
the ledger of what was resident and what moved at every step.

    engine = Engine.from_card("tiny-wan2.2-a14b", offload="components")
    engine.generate([...])
    engine.residency.steps[-1].resident      # {"vae": 1234567}: bytes on the device per component
    engine.residency.moves_in                # {"text_encoder": 1, "transformer": 1, "transformer_2": 1, "vae": 1}

`offload="components"`: a component (a text encoder, the transformer, each expert, the VAE) is on the
device only while its steps run (fvgraph/runtime/component_residency.py moves it; the scheduler
prefers the resident component's steps, fvgraph/runtime/residency_order.py). `"blocks:N"`: a Wan
transformer's blocks stay in host memory and run from two fixed device slots of N blocks, the next
group copied in while one runs (fvgraph/runtime/block_streaming.py); the other weights stay resident.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

DENOISERS = ("transformer", "transformer_2")  # the components block offload streams (Wan 2.2 A14B's experts share a layout)
RULE = 'offload must be None, "components", or "blocks:N" with N a whole number >= 1 (transformer blocks per group)'
_BLOCKS = re.compile(r"blocks:(\d+)")


@dataclass(frozen=True)
class OffloadPolicy:
    """What an engine offloads: whole components, or groups of `blocks` transformer blocks."""

    mode: str  # "components" | "blocks"
    blocks: int = 0  # transformer blocks per group ("blocks" mode)

    @classmethod
    def parse(cls, value: object) -> OffloadPolicy | None:
        """None, "components" or "blocks:N"; anything else is a ValueError naming `offload` and the rule."""
        if value is None:
            return None
        if isinstance(value, OffloadPolicy):
            return value
        if value == "components":
            return cls("components")
        match = _BLOCKS.fullmatch(value) if isinstance(value, str) else None
        if match is None or int(match.group(1)) < 1:
            raise ValueError(f"offload={value!r}: {RULE}")
        return cls("blocks", int(match.group(1)))

    def __str__(self) -> str:
        return self.mode if self.mode == "components" else f"blocks:{self.blocks}"

    def host_parts(self, name: str, module: nn.Module) -> tuple[nn.Module, ...]:
        """The parts of component `name` that stay in host memory from the load on (never placed on the
        device whole): all of it under "components" (it comes to the device at its first step), a
        denoiser's `blocks` list under "blocks:N" (streamed a group at a time into fixed slots)."""
        if self.mode == "components":
            return (module,)
        blocks = getattr(module, "blocks", None)
        return (blocks,) if name in DENOISERS and isinstance(blocks, nn.ModuleList) else ()


@dataclass
class StepResidency:
    """One group run (one step kind, one or more requests): the bytes each component held on the
    device while it ran, and the moves made for it (bytes copied in, bytes released)."""

    kind: str
    resident: dict[str, int]  # component -> bytes on the device while the step ran
    moved_in: dict[str, int] = field(default_factory=dict)  # component -> bytes copied host -> device for it
    moved_out: dict[str, int] = field(default_factory=dict)  # component -> device bytes given up for it
    tensors_in: dict[str, int] = field(default_factory=dict)  # block offload: block group -> tensors copied for it


@dataclass
class ResidencyLedger:
    """What was resident at each step and what moved, per component; totals over the engine's life.

    A move in copies a component's weights from host memory onto the device (a prefetch counts when it
    is made); a move out gives its device copy up (`written_back` counts the bytes copied back first,
    which happens only when the device copy was changed in place, e.g. by `update_weights`)."""

    steps: list[StepResidency] = field(default_factory=list)
    moves_in: Counter = field(default_factory=Counter)
    bytes_in: Counter = field(default_factory=Counter)
    moves_out: Counter = field(default_factory=Counter)
    bytes_out: Counter = field(default_factory=Counter)
    written_back: Counter = field(default_factory=Counter)
    peak_resident: int = 0  # the most device bytes held by components at once
    planned_peak: int = 0  # the most it can hold, bounded from the plan (ComponentResidency.planned_peak_bytes)
    # Of planned_peak, what is on the device from the engine's build on (block offload: all of it, the
    # resident weights and the slots); a budget read from the device's free memory already lacks it.
    held_from_build: int = 0
    _pending_in: dict[str, int] = field(default_factory=dict, repr=False)
    _pending_out: dict[str, int] = field(default_factory=dict, repr=False)
    _pending_tensors: dict[str, int] = field(default_factory=dict, repr=False)

    def moved(self, component: str, nbytes: int, into_device: bool, moves: int = 1, tensors: int = 0) -> None:
        """Record `moves` moves of `component` (in: copied onto the device; out: its device copy given
        up), `nbytes` in all; block offload's component is a block group, and it counts `tensors` too."""
        counter, total, pending = (self.moves_in, self.bytes_in, self._pending_in) if into_device else \
            (self.moves_out, self.bytes_out, self._pending_out)  # fmt: skip
        counter[component] += moves
        total[component] += nbytes
        pending[component] = pending.get(component, 0) + nbytes
        if tensors:
            self._pending_tensors[component] = self._pending_tensors.get(component, 0) + tensors

    def step(self, kind: str, resident: dict[str, int]) -> None:
        """Record a step of `kind` about to run with `resident` on the device; the moves since the last
        step are its own."""
        self.steps.append(StepResidency(kind, dict(resident), self._pending_in, self._pending_out, self._pending_tensors))
        self._pending_in, self._pending_out, self._pending_tensors = {}, {}, {}
        self.peak_resident = max(self.peak_resident, sum(resident.values()))

    def clear(self) -> None:
        """Forget the steps and totals so far (what is resident stays so)."""
        self.steps.clear()
        for counter in (self.moves_in, self.bytes_in, self.moves_out, self.bytes_out, self.written_back):
            counter.clear()
        self.peak_resident = 0
        self._pending_in, self._pending_out, self._pending_tensors = {}, {}, {}
