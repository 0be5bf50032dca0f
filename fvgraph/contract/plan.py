"""A loop's next step, as the runtime receives it: one request's WorkPlan (or Done), and the shape
signature that decides which plans run together as one batch.

`loop.next(state)` returns a WorkPlan naming the step kind and handing over the step's input tensors,
batch dim first (batch-1 each); the runtime batches plans of equal signature and hands each request
its rows of the outputs (a StepResult) for `loop.advance`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

StepResult = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ShapeSignature:
    """What must match for two plans to run as one batch: step kind and every input's shape past the
    batch dim and dtype. Per-request scalars are [B] tensors, so they never split a signature."""

    kind: str
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]

    def __hash__(self) -> int:
        return self._hash  # the scheduler groups every plan of every tick by signature

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.kind, self.inputs))

    @classmethod
    def of(cls, kind: str, inputs: dict[str, torch.Tensor]) -> ShapeSignature:
        facts = tuple((name, tuple(t.shape[1:]), str(t.dtype).removeprefix("torch.")) for name, t in inputs.items())
        return cls(kind, facts)


@dataclass(slots=True)  # one per request per step
class WorkPlan:
    """One step of one request: `inputs` are batch-1 tensors, keyed by the step function's arguments;
    their roles (which stay constant for the request, which are carried) are its StepKind's."""

    request_id: str
    kind: str
    inputs: dict[str, torch.Tensor]
    step_index: int = 0
    pixel_shape: tuple[int, int, int] | None = None  # (frames, height, width) of the video it serves
    # Computed from `inputs` when not given. A loop whose inputs keep their shapes from step to step
    # may pass the one it computed at the first step: the scheduler reads it for every plan.
    signature: ShapeSignature | None = None
    # On an engine with adapter slots: how many places of the step's adapter rows (the columns of
    # its lora_index / lora_scale inputs) this plan's request uses, known on the host; None: the
    # step takes no adapter rows. A batch runs the step with only the places one of its rows uses,
    # and without adapter rows at all when none does (fvgraph/runtime/adapter_variant.py).
    adapter_places: int | None = None

    def __post_init__(self) -> None:
        if self.signature is None:
            self.signature = ShapeSignature.of(self.kind, self.inputs)


@dataclass(frozen=True)
class Done:
    """The loop has nothing left to run; `finalize()` builds the result."""
