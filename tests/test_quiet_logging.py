"""Logging calls inside a traced step are no-ops, and torch's compile-metrics log stays quiet about it."""

import logging

import torch

from fvgraph.compile.step_capture import trace_graph

_log = logging.getLogger("a_library_logging_inside_its_forward")


def _step(x):
    _log.warning("inside the step")
    return (x * 2,)


def test_a_logging_call_inside_the_step_does_not_break_the_graph():
    x = torch.randn(3)
    gm = trace_graph(_step, [x])
    assert torch.equal(gm(x)[0], x * 2)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_torch_whose_metrics_log_cannot_sort_our_set_logs_no_error(monkeypatch):
    # torch before 2.13 sorts every set in dynamo's config when it logs compile metrics; a set of
    # functions does not sort. Stand in for that torch here, whatever the installed one does.
    def sorts_every_set():
        return sorted(torch._dynamo.config.ignore_logging_functions)

    monkeypatch.setattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", sorts_every_set)
    metrics_log = logging.getLogger("torch._dynamo.metrics_context")  # torch's loggers do not propagate
    seen = _Records()
    metrics_log.addHandler(seen)
    try:
        trace_graph(_step, [torch.randn(4)])
        assert seen.records == []
        # The filter is gone after the trace: that failure logged elsewhere still reaches the log.
        metrics_log.error("Unexpected exception logging compilation metrics")
        assert len(seen.records) == 1
    finally:
        metrics_log.removeHandler(seen)
