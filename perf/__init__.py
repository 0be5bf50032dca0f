"""Benchmarks that print JSON (installed as fvgraph.perf, so `fvgraph bench NAME` runs them too)."""
