"""What a loop declares about each step kind it emits, for the runtime that runs it: the component it
runs on, how it is timed and compiled, and its inputs and outputs by name and role.

The roles are what the runtime acts on, so it needs no naming convention: a graph runner keeps a
request's CONSTANT inputs in place while the request keeps its row, the engine copies HOST outputs
to the host for a whole group in one transfer, and a CARRIED output is state the loop hands back to
a later step (sampler history, a kept residual). A plan may leave out an input its kind declares
(an optional conditioning); it may not pass one the kind does not declare.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType


class Role(enum.Enum):
    STEP = "step"  # new at every step: latents, timestep, the sampler's coefficients
    CONSTANT = "constant"  # equal at every step of the request: embeddings, guidance scale
    CARRIED = "carried"  # an output a later step of the request takes back as an input
    HOST = "host"  # a small output the loop reads on the host to decide its next step
    RESULT = "result"  # what the loop folds into its state and keeps (new latents, a decoded video)


def _frozen(roles: Mapping[str, Role]) -> Mapping[str, Role]:
    return MappingProxyType(dict(roles))


@dataclass(frozen=True, eq=False)
class StepKind:
    """One step kind of a loop. `inputs` / `outputs` map each name to its Role."""

    name: str
    component: str  # the card component the step runs (a factor of the compile signature)
    phase: str  # the key its run time is added to in Result.timings
    compiled: bool = False  # compiled at -O1 and up unless CompileConfig.step_kinds says otherwise
    per_inference_step: bool = False  # runs once per denoising step (progress bars, per-step timing)
    # The first launch of a step the loop splits in two: the engine runs the request's next step (the
    # rest, chosen from this one's outputs) within the same scheduler tick, after this kind's group.
    continues: bool = False
    inputs: Mapping[str, Role] = field(default_factory=dict)
    outputs: Mapping[str, Role] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _frozen(self.inputs))
        object.__setattr__(self, "outputs", _frozen(self.outputs))

    @property
    def constants(self) -> frozenset[str]:
        """The inputs equal at every step of a request (a batch runner may keep them in place)."""
        return frozenset(name for name, role in self.inputs.items() if role is Role.CONSTANT)

    @property
    def host_outputs(self) -> tuple[str, ...]:
        """Small outputs the loop reads on the host: copied for the whole group in one transfer, so
        the loop never syncs once per request."""
        return tuple(name for name, role in self.outputs.items() if role is Role.HOST)

    def input_role(self, name: str) -> Role:
        role = self.inputs.get(name)
        if role is None:
            raise ValueError(f"step kind {self.name!r} declares no input {name!r}; it takes {', '.join(self.inputs)}")
        return role

    def derived(self, name: str, inputs: Mapping[str, Role] | None = None, outputs: Mapping[str, Role] | None = None,
                drop_inputs: tuple[str, ...] = (), drop_outputs: tuple[str, ...] = (), **changes) -> StepKind:  # fmt: skip
        """A kind like this one under another name, with inputs / outputs added or dropped (a step
        caching method's kinds derive from the loop's denoise kind)."""
        ins = {k: v for k, v in self.inputs.items() if k not in drop_inputs} | dict(inputs or {})
        outs = {k: v for k, v in self.outputs.items() if k not in drop_outputs} | dict(outputs or {})
        return replace(self, name=name, inputs=ins, outputs=outs, **changes)
