"""RequestSlot: what the runtime keeps for one request between its steps, apart from the loop's state.

The loop's state holds what the loop derives (schedule, latents, history); the slot holds what the
runtime derives: the hoisted prologue outputs of the request's compiled step (values computed once
from its request constants) and, by its identity, which row of a batch's static buffers already
holds this request's constants. The slot never leaves the process and is never saved: a resumed
request gets a fresh one and the runtime recomputes what it held.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)  # compared and hashed by identity: a buffer row's owner is this object
class RequestSlot:
    # Hoisted values by the graph runner's values key (the step at any bucket: one set serves every
    # bucket whose graphs lay them out alike), one tensor per hoisted graph output: views of this
    # request's rows of what the prologue run that computed them returned (those outputs live while
    # a request holds them).
    hoisted: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)

    def hoisted_for(self, key: tuple) -> list[torch.Tensor] | None:
        return self.hoisted.get(key)

    def keep_hoisted(self, key: tuple, values: list[torch.Tensor]) -> None:
        self.hoisted[key] = values


class RequestSlots:
    """The slot of each live loop state, found by the state object itself. A slot is dropped when its
    state is released or garbage collected, so a request stepped by hand (Engine.step) keeps its
    hoisted values from step to step without the caller holding anything but the state."""

    def __init__(self) -> None:
        self._slots: dict[int, RequestSlot] = {}

    def of(self, state: object) -> RequestSlot:
        slot = self._slots.get(id(state))
        if slot is None:
            slot = self._slots[id(state)] = RequestSlot()
            # The id of a collected object can be reused: forget the slot when its state goes.
            weakref.finalize(state, self._slots.pop, id(state), None)
        return slot

    def release(self, state: object) -> None:
        self._slots.pop(id(state), None)

    def __len__(self) -> int:
        return len(self._slots)
