"""The driven-loop contract: a loop describes its next step; the runtime decides when and with whom it runs.

    state = loop.init(request)
    while not isinstance(plan := loop.next(state), Done):
        result = runtime.execute(plan)        # the only place kernels run: batched, compiled, graphed
        loop.advance(state, result)
    result = loop.finalize(state)

`next()` is kernel-free: it reads the state and names the step kind, its shape signature and its input
tensors. All per-request state lives in the loop's state object, which is serializable, so a request
can stop between any two steps and resume elsewhere with the same result.

A loop is the only place that knows its step kinds: it declares them (`StepKind`: the component a
kind runs, whether it is compiled, its timing phase), builds their step modules, checks a request
against its card, and moves its state to another device on resume. The runtime reads those
declarations and names no loop; fvgraph/loops/registry.py picks a card's loop by id.

The contract is typed end to end: `Loop[S]` runs states of type S (each a LoopState, whose `phase`
is a `Phase`), takes a `Request` and gives a `Result`. Those two live a layer above (fvgraph/request.py)
and are named here for type checkers only, so the contract still imports nothing of fvgraph above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import Done, StepResult, WorkPlan
from fvgraph.contract.saved_state import read_saved_fields
from fvgraph.contract.step_kind import StepKind

if TYPE_CHECKING:  # a layer above: named for type checkers, never imported at run time
    from fvgraph.models.components import Components
    from fvgraph.request import Request, Result


class LoopState(Protocol):
    """What the runtime reads of any loop's state: which request, its seed, where its time went."""

    request_id: str
    seed: int
    phase: Phase
    step_index: int
    timings: dict[str, float]

    def save(self, path: str | Path) -> None: ...


S = TypeVar("S", bound=LoopState)


class Loop(Protocol[S]):
    """The contract between a loop and the runtime. The runtime reads `loop_id`, `step_kinds` and
    `components` and calls the methods; everything else about the loop is its own."""

    loop_id: str
    state_type: type[S]  # has .load(path): what save() wrote
    step_kinds: dict[str, StepKind]
    components: Components
    reads: frozenset[str]  # the family-specific Request fields it reads; it refuses the others
    step_caching_methods: tuple[str, ...]  # the step-caching methods its requests may pick
    projection_layout: Callable[[nn.Module, Any], None] | None  # the eager path's projection reuse; None: none

    def check_request(self, request: Request) -> Request: ...  # resolved against the card; raises RequestRejected

    def init(self, request: Request) -> S: ...

    def next(self, state: S) -> WorkPlan | Done: ...

    def advance(self, state: S, result: StepResult) -> S: ...

    def finalize(self, state: S) -> Result: ...
    def take_preview(self, state: S) -> Any: ...  # the PreviewEvent the last step made for it (once), else None
    def take_frames(self, state: S) -> Any: ...  # the DecodedFrames its last decode step made final (once), else None

    def adopt(self, state: S) -> S: ...  # a state saved elsewhere (same card), moved onto this loop's device

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]: ...  # one module per kind; taps: parity variants

    def warmup_request(self, num_frames: int, height: int, width: int, guidance_scale: float, steps: int) -> Request: ...

    # Warmup: plans of the kinds a request may run in `plan`'s place, decided by data the warmup run
    # need not produce (FBCache's compute / reuse pattern per branch); the engine prepares them too.
    def warmup_variants(self, plan: WorkPlan) -> list[WorkPlan]: ...


class SerializableState:
    """Mixin for dataclass loop states: save/load as plain tensors and Python values (weights_only safe)."""

    def save(self, path: str | Path) -> None:
        """Fields marked `metadata={"transient": True}` hold derived data and are rebuilt on resume; a
        field marked `metadata={"load": reader}` holds a part that saves itself (`.saved()`) and that
        `reader` reads back (a loop state's step caching)."""
        torch.save({"type": type(self).__name__, "fields": self.saved_fields()}, path)

    def saved_fields(self) -> dict[str, Any]:
        """What `save` writes for each field: plain tensors and Python values."""
        return {f.name: _compact(_plain(getattr(self, f.name))) for f in dataclasses.fields(self) if not f.metadata.get("transient")}

    @classmethod
    def load(cls, path: str | Path):
        """ValueError, naming the file and the field, for a file that is not a sound saved state."""
        return cls(**read_saved_fields(cls, path))


@runtime_checkable
class SavedPart(Protocol):
    """A part of a loop state that saves itself as plain values (a request's step-caching state)."""

    def saved(self) -> dict[str, Any]: ...


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):  # a phase: saved as its value, read back by the field's "load" reader
        return value.value
    return value.saved() if isinstance(value, SavedPart) else value


def _compact(value: Any) -> Any:
    """A tensor that views a larger one (a request's rows of a batch output) saved as its own copy:
    torch.save writes a view's whole storage."""
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
        return value.clone()
    if isinstance(value, list):
        return [_compact(v) for v in value]
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    return value
