"""Benchmarks that print JSON (installed as fvgraph.perf, so `fvgraph bench NAME` runs them too)."""

import torch


def sync(device: torch.device) -> None:
    """Wait for the device before reading a wall clock (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
