"""Folding one executed group's outputs back into its requests' loop states.

After a group ran, its small host outputs come to the host in one transfer, each request's rows are
checked finite, its time is added to its phase, and the loop advances it. A request whose outputs are
not finite, or do not fold back, fails alone, naming the step; the others carry on. Returns the
(state, error) pairs that failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fvgraph.contract.loop import Loop, LoopState
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.runtime.finite_check import all_finite
from fvgraph.runtime.host_outputs import copy_to_host

log = logging.getLogger(__name__)


def fold_back(loop: Loop, group: list[tuple[LoopState, WorkPlan]], results: list[StepResult], elapsed: float,
              compiled_for_it: float, on_step: Callable | None, on_result: Callable | None) -> list[tuple]:  # fmt: skip
    kind = loop.step_kinds[group[0][1].kind]
    try:
        if kind.host_outputs:
            copy_to_host(results, kind.host_outputs)
        finite_rows = all_finite(results)
    except Exception as err:  # outputs not as the kind declares them: the group fails, the tick goes on
        log.exception("%s step: its outputs could not be read back", group[0][1].kind)
        return [(state, err) for state, _ in group]
    phase = kind.phase
    failures = []
    for (state, plan), result, finite in zip(group, results, finite_rows):
        if not finite:  # garbage must not come back as ok: the request fails here, naming the step
            bad = sorted(k for k, t in result.items()
                         if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all())
            failures.append((state, FloatingPointError(
                f"{plan.kind} step {plan.step_index}: outputs {bad} are not finite (NaN or Inf)")))  # fmt: skip
            continue
        if compiled_for_it:
            state.timings["compile"] = state.timings.get("compile", 0.0) + compiled_for_it
        state.timings[phase] = state.timings.get(phase, 0.0) + elapsed
        if on_result is not None:
            on_result(state, plan, result)
        try:
            loop.advance(state, result)
        except Exception as err:  # this request's outputs do not fold back: it fails, the others carry on
            log.exception("request %s failed folding back %s step %d", state.request_id, plan.kind, plan.step_index)
            failures.append((state, RuntimeError(
                f"{plan.kind} step {plan.step_index}: its outputs do not fold back into the request: {err!r}")))
            continue
        if on_step is not None:
            on_step(state, plan.kind)
    return failures
