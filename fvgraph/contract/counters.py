"""Counters of the things that must not happen by surprise: compiles, fallbacks, prologue runs.

Tests assert exact deltas, e.g. that a full run after warmup adds zero compiles:

    with engine.counters.expect(compiles=0, compiled_steps=12):
        engine.generate(requests)
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Counters:
    compiles: int = 0  # step graphs captured + compiled (one per signature)
    compile_seconds: float = 0.0
    compiled_steps: int = 0  # steps served by a compiled graph
    eager_steps: int = 0  # steps served by the eager executor
    fallbacks: int = 0  # steps that wanted a compiled graph and ran eager instead
    prologue_runs: int = 0  # hoisted per-request prologues computed (one run covers a group)
    hoisted_rows_copied: int = 0  # a request's hoisted values copied into a batch row (it arrived there, or moved)
    captures: int = 0  # CUDA graphs captured
    replays: int = 0  # CUDA graph replays
    graphs_dropped: int = 0  # CUDA graphs dropped because the weights they read were freed (sleep); captured again
    batches: int = 0  # groups of steps run as one compiled batch
    batches_redone: int = 0  # running ahead: a batch launched before its tick was committed, dropped and run again
    capture_cache_hits: int = 0  # compiled steps loaded from the capture cache instead of compiled
    capture_cache_rejects: int = 0  # capture cache entries found unusable (stale, foreign, corrupted) and rebuilt
    capture_cache_stores: int = 0  # compiled steps published to the capture cache

    def snapshot(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """How much each counter grew since `before` (a snapshot)."""
        return {name: value - before[name] for name, value in self.snapshot().items()}

    @contextmanager
    def expect(self, **deltas: int):
        """Assert that exactly these counters change by exactly these amounts inside the block."""
        unknown = set(deltas) - set(self.snapshot())
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}; known: {sorted(self.snapshot())}")
        before = self.snapshot()
        yield self
        grew = self.since(before)
        got = {name: grew[name] for name in deltas}
        if got != deltas:
            raise AssertionError(f"counter deltas {got} != expected {deltas}")
