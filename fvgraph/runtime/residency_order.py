"""Resident first: with component offload, the order a tick's groups run in, so that requests at
different stages do not move components back and forth every tick.

The policy (one engine with `offload="components"`):
- a tick runs the groups whose components are all resident already; the other groups wait;
- when no group's components are resident, the first group (in row order, the oldest requests
  first) chooses: it runs, with every group reading the same components;
- a group none of whose requests has waited `patience` ticks keeps waiting; once one has, it runs in
  that tick, after the resident groups, so a request is never held back more than `patience` ticks.

So with two experts and requests on both sides of the boundary, the resident expert's steps run until
they run out (or the other side's requests have waited `patience` ticks), then the other expert comes
in once for all of its steps. Results do not depend on the order: each request's steps run in its
own order, and a step's numerics do not depend on its tick. The arrangement is also handed to the
residency as the tick's kinds in run order, which is what it prefetches from.
"""

from __future__ import annotations

from typing import Any

from fvgraph.runtime.component_residency import ComponentResidency

PATIENCE = 4  # ticks a group may wait behind the resident component's groups


class ResidentFirst:
    def __init__(self, residency: ComponentResidency, patience: int = PATIENCE):
        self.residency = residency
        self.patience = patience
        self._waited: dict[str, int] = {}  # request id -> ticks its group has waited so far

    def arrange(self, groups: list[Any]) -> tuple[list[Any], list[Any]]:
        """(the groups to run this tick, in order; the groups that wait). Changes nothing but the
        residency's prefetch hint."""
        needs = [self.residency.components_of(group.members[0][1].kind) for group in groups]
        resident = set(self.residency.resident)
        ready = [i for i, need in enumerate(needs) if need <= resident]
        if not ready and groups:
            ready = [i for i, need in enumerate(needs) if need == needs[0]]
        overdue = [i for i in range(len(groups)) if i not in ready and self._overdue(groups[i])]
        run = [groups[i] for i in (*ready, *overdue)]
        self.residency.upcoming = [group.members[0][1].kind for group in run]
        return run, [groups[i] for i in range(len(groups)) if i not in ready and i not in overdue]

    def committed(self, waiting: list[Any]) -> None:
        """The tick was committed with `waiting` groups held back: their requests waited one more tick."""
        self._waited = {state.request_id: self._waited.get(state.request_id, 0) + 1
                        for group in waiting for state, _ in group.members}  # fmt: skip

    def _overdue(self, group: Any) -> bool:
        return any(self._waited.get(state.request_id, 0) >= self.patience for state, _ in group.members)
