"""The driven-loop contract: a loop describes its next step; the runtime decides when and with whom it runs.

    state = loop.init(request)
    while not isinstance(plan := loop.next(state), Done):
        result = runtime.execute(plan)        # the only place kernels run: batched, compiled, graphed
        loop.advance(state, result)
    result = loop.finalize(state)

`next()` is kernel-free: it reads the state and names the step kind, its shape signature and its input
tensors. All per-request state lives in the loop's state object, which is serializable, so a request
can stop between any two steps and resume elsewhere with the same result.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from fvgraph.saved_state import read_saved_fields

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


@dataclass
class WorkPlan:
    """One step of one request: `inputs` are batch-1 tensors, keyed by the step function's arguments."""

    request_id: str
    kind: str
    inputs: dict[str, torch.Tensor]
    step_index: int = 0
    # Per-request scratch the runtime may fill with values derived from request constants (hoisted
    # prologue outputs). It lives in the request's state, never in the runtime.
    request_cache: dict = field(default_factory=dict)
    pixel_shape: tuple[int, int, int] | None = None  # (frames, height, width) of the video it serves
    # Inputs whose value is the same at every step of this request (embeddings, guidance scale): a
    # batch runner may keep them in place while the request keeps its row.
    constants: frozenset[str] = frozenset()
    # Computed from `inputs` when not given. A loop whose inputs keep their shapes from step to step
    # may pass the one it computed at the first step: the scheduler reads it for every plan.
    signature: ShapeSignature | None = None

    def __post_init__(self) -> None:
        if self.signature is None:
            self.signature = ShapeSignature.of(self.kind, self.inputs)


@dataclass(frozen=True)
class Done:
    """The loop has nothing left to run; `finalize()` builds the result."""


class Loop(Protocol):
    def init(self, request: Any) -> Any: ...

    def next(self, state: Any) -> WorkPlan | Done: ...

    def advance(self, state: Any, result: StepResult) -> Any: ...

    def finalize(self, state: Any) -> Any: ...


class SerializableState:
    """Mixin for dataclass loop states: save/load as plain tensors and Python values (weights_only safe)."""

    def save(self, path: str | Path) -> None:
        """Fields marked `metadata={"transient": True}` hold derived data and are rebuilt on resume."""
        payload = {f.name: _compact(getattr(self, f.name)) for f in dataclasses.fields(self) if not f.metadata.get("transient")}
        torch.save({"type": type(self).__name__, "fields": payload}, path)

    @classmethod
    def load(cls, path: str | Path):
        """ValueError, naming the file and the field, for a file that is not a sound saved state."""
        return cls(**read_saved_fields(cls, path))


def _compact(value: Any) -> Any:
    """A tensor that views a larger one (a request's rows of a batch output) saved as its own copy:
    torch.save writes a view's whole storage."""
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
        return value.clone()
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value
