"""New weights into a running engine with nothing recompiled (the Engine's `update_weights` delegates here).

    engine.update_weights(trainer.transformer.state_dict(), version="step-120")

The sync happens between ticks. First the requests in flight reach a step boundary: with
`in_flight="finish"` (the default) they run to their end on the weights they started with; with
"stop" they are cancelled at their next step boundary (status 'cancelled'). Then the new values are
copied into the same parameter storage, so every compiled step, whose graph takes the weights as
arguments (fvgraph/compile/step_capture.py), runs them as they are: the next steps compile nothing.
The weights version changes (loop states, results and rollout records carry it, and a state saved on
the old version is refused on resume), and the eager projection cache, whose entries were computed
from the old weights, is emptied. No request ever mixes two versions. On a sleeping engine the values
go where its weights are (fvgraph/engine/sleep.py): into the host copies (level 1), or held for wake
(level 2).

Refused, before anything changes: an unknown or missing parameter name, a shape mismatch, an engine
running FP8 copies of the weights (-O3: they would go stale), and a parallel engine (its worker ranks
hold their own copies).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch

from fvgraph.contract.loop import Loop, LoopState
from fvgraph.engine.in_flight import settle_in_flight
from fvgraph.engine.sleep import EngineSleep
from fvgraph.parallel.executor import ParallelExecutor
from fvgraph.runtime.executor import CompiledExecutor, EagerExecutor
from fvgraph.runtime.projection_cache import ExactProjectionCache
from fvgraph.runtime.scheduler import Scheduler


class WeightSync:
    """Handed the engine's loop (its components: the denoiser and the weights version), executor and
    eager projection cache, its scheduler (whether requests remain), and the engine calls it drives:
    `live_states`, `refuse_in_tick(what, instead)`, `cancel(request_id)`, `tick(what)` (one tick
    without callbacks, its results left for the next `Engine.tick`) and `drain`; and its EngineSleep,
    which says where a sleeping engine's weights are written."""

    def __init__(self, loop: Loop, executor: EagerExecutor | CompiledExecutor | ParallelExecutor,
                 projection_cache: ExactProjectionCache | None, scheduler: Scheduler,
                 live_states: Callable[[], list[LoopState]], refuse_in_tick: Callable[[str, str], None],
                 cancel: Callable[[str], bool], tick: Callable[[str], None], drain: Callable[[], None],
                 sleep: EngineSleep):  # fmt: skip
        self._sleep = sleep
        self._loop, self._executor, self._projection_cache, self._scheduler = loop, executor, projection_cache, scheduler
        self._live_states, self._refuse_in_tick = live_states, refuse_in_tick
        self._cancel, self._tick, self._drain = cancel, tick, drain

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: str,
                       in_flight: Literal["finish", "stop"] = "finish") -> dict:  # fmt: skip
        """Copy `weights` (the denoiser's state-dict names: all of its parameters, or a subset) into the
        denoiser and call the result `version`. Returns what happened to the requests in flight."""
        self._refuse_in_tick("update_weights", "sync weights between ticks, after the callback returns")
        if in_flight not in ("finish", "stop"):
            raise ValueError(f"in_flight={in_flight!r} must be 'finish' or 'stop'")
        components = self._loop.components
        if not isinstance(version, str) or not version or version == components.weights_version:
            raise ValueError(f"version={version!r} must be a new, non-empty name for these weights "
                             f"(the engine runs {components.weights_version!r})")  # fmt: skip
        targets = self._weight_targets(weights)
        ids = [s.request_id for s in self._live_states()]
        settle_in_flight(ids, in_flight == "stop", "update_weights", self._cancel, self._scheduler.has_work, self._tick, self._drain)
        with torch.no_grad():
            for target, value in targets:
                self._sleep.write(target, value)
        components.weights_version = version
        if self._projection_cache is not None:
            self._projection_cache.clear()
        return {"version": version, "finished" if in_flight == "finish" else "stopped": ids}

    def _weight_targets(self, weights: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, new value) pairs, every one checked before any is copied."""
        if isinstance(self._executor, ParallelExecutor):
            raise ValueError("update_weights on a parallel engine is not supported: its worker ranks hold their own weights")
        compiler = self._executor.compiler
        if compiler is not None and compiler.config.passes.runs("quantize"):
            raise ValueError("update_weights at -O3: the denoiser runs FP8 copies of its weights, which would go stale; "
                             "serve rollouts at -O2 or below")  # fmt: skip
        own = dict(self._loop.components.transformer.named_parameters())
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise KeyError(f"update_weights: {unknown[0]!r} ({len(unknown)} such names) is not a parameter of the denoiser")
        pairs = []
        for name, value in weights.items():
            target = own[name]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
                got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"update_weights: {name!r} must be a tensor of shape {list(target.shape)}, got {got}")
            if value.is_complex() or value.dtype == torch.bool:
                raise ValueError(f"update_weights: {name!r} is {value.dtype}; the denoiser's parameter is {target.dtype} (real values)")
            cast = value.detach().to(self._sleep.value_device(target), target.dtype)
            # Checked after the cast: a float64 1e300 is finite, and Inf once it is the parameter's dtype.
            if cast.is_floating_point() and not torch.isfinite(cast).all():
                raise ValueError(f"update_weights: {name!r} holds NaN or Inf values as {target.dtype} (the parameter's dtype)")
            pairs.append((target, cast))
        return pairs
