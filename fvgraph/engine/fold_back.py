"""Folding one executed group's outputs back into its requests' loop states.

After a group ran, its small host outputs come to the host in one transfer, each request's rows are
checked finite, its time is added to its phase, and the loop advances it. A request whose outputs are
not finite, or do not fold back, fails alone, naming the step; the others carry on. Returns the
(state, error) pairs that failed.

Running ahead (fvgraph/engine/run_ahead.py) splits this in two: `advance_ahead` right after the
launch, on the device tensors and before the finite flags are read, and `settle` once they are.
A request whose rows turn out not finite fails then, as it would have serially; that it advanced
on garbage changes nothing, since a failed request's state is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fvgraph.contract.loop import Loop, LoopState
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.runtime.finite_check import all_finite
from fvgraph.runtime.host_outputs import copy_to_host

log = logging.getLogger(__name__)

StepCallback = Callable[[LoopState, str], None]  # after each request's step: its state and the step kind
ResultCallback = Callable[[LoopState, WorkPlan, dict], None]  # sees every step's outputs (parity taps)
PreviewCallback = Callable[[Any], None]  # takes a fvgraph.events.PreviewEvent (Request.preview_every)
FramesCallback = Callable[[Any], None]  # takes a fvgraph.events.DecodedFrames (a video's frames as they decode)


def with_previews(loop: Loop, on_step: StepCallback | None, on_preview: PreviewCallback | None,
                  on_frames: FramesCallback | None = None) -> StepCallback | None:  # fmt: skip
    """`on_step`, then `on_preview` with the preview the step just made for the request, if it made one,
    and `on_frames` with the frames it made final (a decode step). Called where on_step is (a settled
    step, in group order), so neither outruns its step."""
    if on_preview is None and on_frames is None:
        return on_step
    take_preview, take_frames = loop.take_preview, loop.take_frames

    def step_and_media(state: LoopState, kind: str) -> None:
        if on_step is not None:
            on_step(state, kind)
        preview = take_preview(state)
        if preview is not None and on_preview is not None:
            on_preview(preview)
        frames = take_frames(state)
        if frames is not None and on_frames is not None:
            on_frames(frames)

    return step_and_media


def fold_back(loop: Loop, group: list[tuple[LoopState, WorkPlan]], results: list[StepResult], elapsed: float,
              compiled_for_it: float, on_step: StepCallback | None, on_result: ResultCallback | None) -> list[tuple]:  # fmt: skip
    kind = loop.step_kinds[group[0][1].kind]
    try:
        if kind.host_outputs:
            copy_to_host(results, kind.host_outputs)
        finite_rows = all_finite(results)
    except Exception as err:  # outputs not as the kind declares them: the group fails, the tick goes on
        log.exception("%s step: its outputs could not be read back", group[0][1].kind)
        return [(state, err) for state, _ in group]
    failures, phase, advance = [], kind.phase, loop.advance
    for (state, plan), result, finite in zip(group, results, finite_rows):
        if not finite:  # garbage must not come back as ok: the request fails here, naming the step
            failures.append((state, _not_finite(plan, result)))
            continue
        timings = state.timings  # _add_time written out: this runs for every request of every batch
        timings[phase] = timings.get(phase, 0.0) + elapsed
        if compiled_for_it:
            timings["compile"] = timings.get("compile", 0.0) + compiled_for_it
        if on_result is not None:
            on_result(state, plan, result)
        try:
            advance(state, result)
        except Exception as err:  # this request's outputs do not fold back: it fails, the others carry on
            failures.append((state, _advance_error(state, plan, err)))
            continue
        if on_step is not None:
            on_step(state, plan.kind)
    return failures


def advance_ahead(loop: Loop, group: list[tuple[LoopState, WorkPlan]], results: list[StepResult]) -> dict[int, Exception]:
    """Advance every request of a launched group (a kind without HOST outputs) before its flags are
    read; returns the errors of those whose outputs did not fold back, by position in the group."""
    errors = {}
    for i, ((state, plan), result) in enumerate(zip(group, results)):
        error = _advance(loop, state, plan, result)
        if error is not None:
            errors[i] = error
    return errors


def settle(loop: Loop, group: list[tuple[LoopState, WorkPlan]], results: list[StepResult], advanced: dict[int, Exception],
           elapsed: float, compiled_for_it: float, on_step: StepCallback | None) -> list[tuple]:  # fmt: skip
    """The rest of fold_back for a group advanced ahead: its finite flags read, then per request the
    failure or its time and on_step, in group order as fold_back. Returns the failed (state, error)."""
    kind = loop.step_kinds[group[0][1].kind]
    try:
        finite_rows = all_finite(results)
    except Exception as err:
        log.exception("%s step: its outputs could not be read back", group[0][1].kind)
        return [(state, err) for state, _ in group]
    failures = []
    for i, ((state, plan), result, finite) in enumerate(zip(group, results, finite_rows)):
        if not finite:
            failures.append((state, _not_finite(plan, result)))
            continue
        _add_time(state, kind.phase, elapsed, compiled_for_it)
        if i in advanced:
            failures.append((state, advanced[i]))
        elif on_step is not None:
            on_step(state, plan.kind)
    return failures


def _not_finite(plan: WorkPlan, result: StepResult) -> FloatingPointError:
    bad = sorted(k for k, t in result.items() if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all())
    return FloatingPointError(f"{plan.kind} step {plan.step_index}: outputs {bad} are not finite (NaN or Inf)")


def _add_time(state: LoopState, phase: str, elapsed: float, compiled_for_it: float) -> None:
    if compiled_for_it:
        state.timings["compile"] = state.timings.get("compile", 0.0) + compiled_for_it
    state.timings[phase] = state.timings.get(phase, 0.0) + elapsed


def _advance(loop: Loop, state: LoopState, plan: WorkPlan, result: StepResult) -> Exception | None:
    try:
        loop.advance(state, result)
    except Exception as err:  # this request's outputs do not fold back: it fails, the others carry on
        return _advance_error(state, plan, err)
    return None


def _advance_error(state: LoopState, plan: WorkPlan, err: Exception) -> RuntimeError:
    log.exception("request %s failed folding back %s step %d", state.request_id, plan.kind, plan.step_index)
    return RuntimeError(f"{plan.kind} step {plan.step_index}: its outputs do not fold back into the request: {err!r}")
