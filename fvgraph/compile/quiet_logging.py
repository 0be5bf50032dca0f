"""Logging calls inside a traced step become no-ops, without breaking torch's own compile logging.

diffusers logs from inside some steps (its context-parallel hooks warn, fvgraph/parallel/ulysses.py);
dynamo would break the graph at each call. `torch._dynamo.config.ignore_logging_functions` makes it
trace them as no-ops. Before torch 2.13, torch's compile-metrics logger sorts every set in dynamo's
config, and a set of functions cannot be sorted: each compile then logs "Unexpected exception logging
compilation metrics" with a traceback (measured on an H100 with torch 2.11). Only the metrics record
fails; the compile does not. Where this torch fails so, that one record is dropped while we trace.
"""

from __future__ import annotations

import contextlib
import logging

import torch

_METRICS_LOGGER = "torch._dynamo.metrics_context"
_METRICS_FAILURE = "Unexpected exception logging compilation metrics"


def logger_methods() -> set:
    """Every logging method of `logging.Logger`, those libraries add (diffusers' `warning_once`) included."""
    names = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")
    return {f for name, f in vars(logging.Logger).items() if callable(f) and (name in names or name.endswith("_once"))}


class _DropMetricsFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _METRICS_FAILURE


def _metrics_log_sorts_our_set() -> bool:
    """Whether this torch logs compile metrics with our set in dynamo's config (2.13 leaves it out)."""
    try:
        torch._dynamo.utils._get_dynamo_config_for_logging()
    except TypeError:
        return False
    return True


@contextlib.contextmanager
def logging_calls_traced_as_no_ops():
    with torch._dynamo.config.patch(ignore_logging_functions=logger_methods()):
        if _metrics_log_sorts_our_set():
            yield
            return
        drop = _DropMetricsFailure()
        logger = logging.getLogger(_METRICS_LOGGER)
        logger.addFilter(drop)
        try:
            yield
        finally:
            logger.removeFilter(drop)
