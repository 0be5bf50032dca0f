"""The server's access log: one line per request as it ends (id, card, shape, steps, status, seconds),
a throughput line at most every `every_s`; and the start line names the playground."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

from fvgraph.cli.serve import started_line
from fvgraph.request import Result
from fvgraph.serving.access_log import AccessLog
from fvgraph.serving.request_events import RequestEvent


def _served(in_flight=2):
    return SimpleNamespace(engine=SimpleNamespace(card=SimpleNamespace(card_id="tiny-wan")), listeners=[], in_flight=in_flight)


def test_one_line_per_request_and_a_throughput_line(caplog):
    served = _served()
    log = AccessLog(served, every_s=0.0)
    assert served.listeners == [log.on_event]
    frames = np.zeros((9, 64, 48, 3), dtype=np.uint8)
    with caplog.at_level(logging.INFO, logger="fvgraph.access"):
        for step in (1, 2):
            log.on_event(RequestEvent("r1", "step", step=step, total=2))
        log.on_event(RequestEvent("r1", "done", result=Result("r1", "ok", frames=frames, timings={"total": 1.234})))
        log.on_event(RequestEvent("r2", "cancelled", reason="timeout", result=Result("r2", "cancelled")))
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == "request r1 tiny-wan 9x64x48 2/2 steps done 1.23 s"
    assert lines[1].startswith("throughput: 1 requests ended in the last ") and lines[1].endswith("1 done; 2 in flight")
    assert lines[2] == "request r2 tiny-wan - 0 steps cancelled (timeout) -"


def test_throughput_waits_for_its_interval(caplog):
    log = AccessLog(_served(), every_s=3600.0)
    with caplog.at_level(logging.INFO, logger="fvgraph.access"):
        log.on_event(RequestEvent("r1", "failed", error="boom", result=Result("r1", "failed", timings={"total": 0.5})))
    assert [record.getMessage() for record in caplog.records] == ["request r1 tiny-wan - 0 steps failed 0.50 s"]


def test_the_start_line_names_the_api_and_the_playground():
    assert started_line("tiny-wan -O1", "http://127.0.0.1:8000", True) == (
        "serving tiny-wan -O1 on http://127.0.0.1:8000/v1; the playground: http://127.0.0.1:8000/ in a browser")
    assert "playground" not in started_line("tiny-wan -O1", "http://127.0.0.1:8000", False)
