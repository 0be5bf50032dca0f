"""perf/bench_import.py reads fvgraph's and torch's cumulative import times from `-X importtime`."""

import pytest

from fvgraph.perf.bench_import import import_seconds

# The shape `python -X importtime` writes: children before their parent, nesting by indentation.
REPORT = """import time: self [us] | cumulative | imported package
import time:       120 |        120 |   _io
import time:       900 |     400000 |         torch._C
import time:      3000 |    1500000 |       torch
import time:       200 |       2500 |         torch._C
import time:      1000 |    1600000 |     fvgraph.caching.settings
import time:       500 |     200000 |     fvgraph.request
import time:       400 |    2100000 |   fvgraph
"""


def test_the_fvgraph_share_is_its_total_less_the_first_torch_import():
    seconds = import_seconds(REPORT)
    assert seconds == pytest.approx({"total": 2.1, "torch": 1.5, "fvgraph": 0.6})


def test_a_report_without_torch_counts_no_torch():
    report = "\n".join(line for line in REPORT.splitlines() if "torch" not in line and "settings" not in line)
    assert import_seconds(report) == pytest.approx({"total": 2.1, "torch": 0.0, "fvgraph": 2.1})


def test_a_first_use_after_the_package_adds_its_outermost_import():
    """`import fvgraph; fvgraph.Request`: the package's names load on first use, after the package's own
    line, so the request module's import is a second outermost line (and torch is nested in it)."""
    report = """import time: self [us] | cumulative | imported package
import time:       800 |        800 | fvgraph
import time:      3000 |    2700000 |     torch
import time:      1000 |    2900000 |   fvgraph.caching.settings
import time:       500 |    3500000 | fvgraph.request
"""
    assert import_seconds(report) == pytest.approx({"total": 3.5008, "torch": 2.7, "fvgraph": 0.8008})


def test_a_report_without_fvgraph_is_refused_naming_it():
    with pytest.raises(RuntimeError, match=r"no import of \['fvgraph'\]"):
        import_seconds("\n".join(line for line in REPORT.splitlines() if not line.endswith("fvgraph")))
