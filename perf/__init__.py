"""Benchmarks that print JSON (installed as fvgraph.perf, so `fvgraph bench NAME` runs them too).
How they time, compare and report is fvgraph.perf.method, the one method they share."""

from fvgraph.perf.method import sync

__all__ = ["sync"]
