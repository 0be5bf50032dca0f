"""The long waits of a served engine (a compile, a capture-cache load: fvgraph/contract/progress.py)
told to the requests that wait on them, as `wait` events (fvgraph/serving/request_events.py): the HTTP
events stream and the playground show "compiling denoise_cfg, batch bucket 1 ..." instead of a request
that sits at step 0 for a minute.

The relay is a handler on the progress logger that keeps only the records of its engine's own thread
(another engine in the same process announces its own waits) and reads the requests in that engine
on that thread, where they are kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from fvgraph.contract.progress import PROGRESS_LOGGER
from fvgraph.serving.request_events import RequestEvent


class WaitRelay(logging.Handler):
    def __init__(self, thread: Callable[[], threading.Thread | None], in_engine: Callable[[], Iterable[str]],
                 send: Callable[[list[RequestEvent]], None]):  # fmt: skip
        super().__init__(level=logging.INFO)
        self._thread, self._in_engine, self._send = thread, in_engine, send

    def emit(self, record: logging.LogRecord) -> None:
        thread = self._thread()
        activity = getattr(record, "progress_activity", None)
        if thread is None or record.thread != thread.ident or activity is None:
            return
        text = f"{activity} {getattr(record, 'progress_label', '')}".strip()
        seconds = getattr(record, "progress_seconds", None) if getattr(record, "progress_event", "") == "end" else None
        self._send([RequestEvent(request_id, "wait", activity=text, wait_seconds=seconds) for request_id in self._in_engine()])

    def attach(self) -> None:
        """Listen; the progress logger is opened to INFO where it was quieter (its records must exist)."""
        logger = logging.getLogger(PROGRESS_LOGGER)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def detach(self) -> None:
        logging.getLogger(PROGRESS_LOGGER).removeHandler(self)
