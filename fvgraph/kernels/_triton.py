"""Whether a Triton kernel may run, and the one log line when an op falls back to its torch reference.

Triton is optional: nothing in fvgraph.kernels imports it at module level, so every op works (through
its reference) on a machine without it. The Triton kernels live in `*_triton.py` files that are only
imported once `use_triton(...)` said yes, or by a test that runs them under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

log = logging.getLogger("fvgraph.kernels")


@functools.cache
def optional_module(name: str):
    """The module if it imports, else None (cached: installs do not change within a process). Every
    optional package is probed through this."""
    try:
        return importlib.import_module(name)
    except Exception:  # absent, or present but broken (no CUDA, ABI mismatch, sys.modules[name] = None)
        return None


def triton_available() -> bool:
    return optional_module("triton") is not None


def use_triton(op: str, *tensors: torch.Tensor) -> bool:
    """True when `op`'s Triton kernel should run: every tensor is on CUDA and Triton imports.

    Otherwise the op runs its torch reference; a CUDA caller without Triton gets one log line per op.
    """
    if not all(t.is_cuda for t in tensors):
        return False
    if triton_available():
        return True
    _log_fallback_once(op, "triton is not importable")
    return False


@functools.cache
def _log_fallback_once(op: str, why: str) -> None:
    """Logs once per (op, reason): the cache is what makes it once."""
    log.warning("fvgraph::%s runs its torch reference on CUDA: %s", op, why)
