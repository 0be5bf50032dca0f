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
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from fvgraph.request import Request

from fvgraph.loops.saved_state import read_saved_fields

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


@dataclass(frozen=True)
class StepKind:
    """What the runtime needs to know about one step kind a loop emits."""

    name: str
    component: str  # the card component the step runs (a factor of the compile signature)
    phase: str  # the key its run time is added to in Result.timings
    compiled: bool = False  # compiled at -O1 and up unless CompileConfig.step_kinds says otherwise
    per_inference_step: bool = False  # runs once per denoising step (progress bars, per-step timing)
    # Small outputs the loop reads on the host to decide its next step: the runtime copies each of
    # them for the whole group in one transfer, so the loop never syncs once per request.
    host_outputs: tuple[str, ...] = ()
    # The first launch of a step the loop splits in two: the engine runs the request's next step (the
    # rest, chosen from this one's outputs) within the same scheduler tick, after this kind's group.
    continues: bool = False


class LoopState(Protocol):
    """What the runtime reads of any loop's state: which request, its seed, where its time went."""

    request_id: str
    seed: int
    timings: dict[str, float]

    def save(self, path: str | Path) -> None: ...


class Loop(Protocol):
    """The contract between a loop and the runtime. The runtime reads `loop_id`, `step_kinds` and
    `components` and calls the methods; everything else about the loop is its own."""

    loop_id: ClassVar[str]
    state_type: ClassVar[type]  # has .load(path): what save() wrote
    step_kinds: dict[str, StepKind]
    components: Any  # fvgraph.runtime.components.Components

    def check_request(self, request: Request) -> Request: ...  # resolved against the card; raises RequestRejected

    def init(self, request: Request) -> LoopState: ...

    def next(self, state: Any) -> WorkPlan | Done: ...

    def advance(self, state: Any, result: StepResult) -> Any: ...

    def finalize(self, state: Any) -> Any: ...

    def adopt(self, state: Any) -> Any: ...  # a state saved elsewhere (same card), moved onto this loop's device

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]: ...  # one module per kind; taps: parity variants

    def warmup_request(self, num_frames: int, height: int, width: int, guidance_scale: float, steps: int) -> Request: ...

    # Warmup: plans of the kinds a request may run in `plan`'s place, decided by data the warmup run
    # need not produce (FBCache's compute / reuse pattern per branch); the engine prepares them too.
    def warmup_variants(self, plan: WorkPlan) -> list[WorkPlan]: ...


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
