"""A run's progress where the time goes: steps done of the total, and the wait under way (compiling a
step graph at a batch bucket, loading one, decoding) with its elapsed seconds.

    with RunProgress(console, stepped_phase, total=16) as progress:
        engine.generate(requests, on_step=lambda state, kind: progress.advance())

Each wait is a line as it begins and as it ends. On a terminal a rich bar below them shows the wait
under way with its seconds ticking; otherwise (a log file, CI, a pipe) a plain status line comes every
`every` seconds while anything runs, so a log shows a 100 s compile as it happens. The waits come from the engine's progress logger
(fvgraph/contract/progress.py); a command adds its own with `wait(...)` (the VAE decode, say).
"""

from __future__ import annotations

import logging
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fvgraph.contract.progress import PROGRESS_LOGGER

PLAIN_EVERY_S = 5.0


class RunProgress(logging.Handler):
    def __init__(self, console: Console, label: str, total: int, every: float = PLAIN_EVERY_S, transient: bool = True):
        super().__init__(level=logging.INFO)
        self.console, self.label, self.total, self.every = console, label, total, every
        self.done = 0
        self._wait: tuple[str, float] | None = None  # what is under way and since when
        self._began = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        self._transient = transient
        self._logger = logging.getLogger(PROGRESS_LOGGER)
        self._saved: tuple[int, bool] | None = None

    # -- what the command reports -------------------------------------------------------------------

    def advance(self, steps: int = 1) -> None:
        with self._lock:
            self.done += steps
            self._wait = None  # a step ran: whatever was awaited is over
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=self._description())

    def wait(self, text: str | None, announce: bool = True) -> None:
        """Show `text` as the wait under way (None: none), e.g. 'vae decode' after the last step; with
        `announce` it is also a line at once, without it only the bar or the next periodic line shows it."""
        with self._lock:
            self._wait = None if text is None else (text, time.perf_counter())
        if announce:
            self._line_now(text)
        if self._bar is not None:
            self._bar.update(self._task, description=self._description())

    # -- the progress logger's records ---------------------------------------------------------------

    def emit(self, record: logging.LogRecord) -> None:
        activity, label = getattr(record, "progress_activity", None), getattr(record, "progress_label", "")
        if activity is None:
            return
        if getattr(record, "progress_event", "begin") == "begin":
            self.wait(f"{activity} {label}")
            return
        seconds = getattr(record, "progress_seconds", 0.0)
        with self._lock:
            self._wait = None
        self._print(f"{activity} {label}: done in {seconds:.1f} s")
        if self._bar is not None:
            self._bar.update(self._task, description=self._description())

    # -- display -------------------------------------------------------------------------------------

    def _description(self) -> str:
        with self._lock:
            wait = self._wait
        if wait is None:
            return self.label
        return f"{wait[0]} ({time.perf_counter() - wait[1]:.0f} s)"

    def _status(self) -> str:
        elapsed = time.perf_counter() - self._began
        return f"{self._description()} | {self.label} {self.done}/{self.total} | {elapsed:.0f} s"

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, soft_wrap=True)
        else:
            self.console.print(text, highlight=False, soft_wrap=True)

    def _line_now(self, text: str | None) -> None:
        # A line on a terminal too (above the bar, kept): what a run waited on reads the same in a log.
        if text is not None:
            self._print(f"{text} ...")

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self._print(self._status())

    def __enter__(self) -> RunProgress:
        self._saved = (self._logger.level, self._logger.propagate)
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False  # shown here, not also by the root handler the command configured
        self._logger.addHandler(self)
        if self.console.is_terminal:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._bar = Progress(*columns, console=self.console, transient=self._transient)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total)
            threading.Thread(target=self._refresh, daemon=True).start()
        else:
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _refresh(self) -> None:  # the label's elapsed seconds tick on a terminal
        while not self._stop.wait(0.5):
            self._bar.update(self._task, description=self._description())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._logger.removeHandler(self)
        if self._saved is not None:
            self._logger.setLevel(self._saved[0])
            self._logger.propagate = self._saved[1]
        if self._bar is not None:
            self._bar.__exit__(*exc)
