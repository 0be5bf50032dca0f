"""Where the time goes, as it goes: the long waits of a run (compiling a step graph, loading one from
the capture cache, decoding a video tile by tile) announced on one logger, so any front end can show
them: the CLI's progress display (fvgraph/cli/progress.py), a server's log, a test's caplog.

    with progress_span("compiling", "denoise_cfg, batch bucket 2"):
        ...  # logs "compiling denoise_cfg, batch bucket 2 ..." now and "... done in 41.2 s" at the end

Each record carries `progress_activity`, `progress_label`, `progress_event` ("begin" | "end") and, on
"end", `progress_seconds`. Nothing is kept between spans: the logger is the only channel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

PROGRESS_LOGGER = "fvgraph.progress"
_log = logging.getLogger(PROGRESS_LOGGER)


@contextmanager
def progress_span(activity: str, label: str) -> Iterator[None]:
    """Announce `activity label` on the progress logger now, and its duration when it ends (also on error)."""
    extra = {"progress_activity": activity, "progress_label": label}
    _log.info("%s %s ...", activity, label, extra={**extra, "progress_event": "begin"})
    began = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - began
        _log.info("%s %s: done in %.1f s", activity, label, seconds,
                  extra={**extra, "progress_event": "end", "progress_seconds": seconds})  # fmt: skip
