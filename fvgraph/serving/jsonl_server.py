"""A JSON-lines serving front end: requests in, one answer line per input line out.

    {"prompt": "a red fox", "seed": 1, "request_id": "fox"}        a request: Request's fields, no tensors
    {"cancel": "fox"}                                             cancel a request in flight or held back

Lines are read on a thread of their own, so a request that arrives while others are mid-run joins
them at the next tick (Engine.submit / tick). Every non-blank input line gets exactly one answer,
whatever it holds (bytes that are not UTF-8, JSON too deep or with too long a number included), and
every answer names the line it answers (`line`) and what that line was (`kind`):

    {"line": 1, "kind": "request", "request_id": "fox", "status": "ok", "seed": 1, "error": null,
     "timings": {...}, "output": "out/fox.gif"}          (+ "cache": Result.cache with step caching)
    {"line": 2, "kind": "cancel", "cancel": "fox", "request_id": null, "status": "accepted", "error": null}

A request line is answered when its request ends (ok, failed, cancelled), or at once when it cannot
be served ("rejected", naming the line, the field and the rule). An id names its output file, so
an id is taken for the whole run by the first request that gets it: a later line reusing it is
rejected with `request_id: null` (the id's one result line stays the original's). Control lines
(cancel) are answered at once with "accepted", "not_in_flight" or "rejected", and never wait behind
request lines held back by `max_in_flight`. Videos are written as `<request_id>.gif` (or .mp4),
latents (output_type "latent") as `<request_id>.safetensors`. At the end of the input the server
finishes what is in flight and returns.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from safetensors.torch import save_file

from fvgraph.engine.engine import Engine
from fvgraph.request import MAX_REQUEST_ID_LENGTH, Request, RequestRejected, Result
from fvgraph.media_file import check_video_output, write_video

log = logging.getLogger(__name__)
# request_id becomes a file name: no separators, no leading dot.
SAFE_ID = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9_.-]{{0,{MAX_REQUEST_ID_LENGTH - 1}}}")
_END = object()


def shown(value: object, limit: int = 64) -> str:
    """`value` as it may appear in an answer or a log line: quoted and cut to `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:limit]) + (f"... ({len(text)} characters)" if len(text) > limit else "")


def _file_key(request_id: str) -> str:
    """Ids that name one file on a case-insensitive file system are one id here."""
    return request_id.lower()


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class LineRejected(Exception):
    """A line that cannot be served. `request_id` is the line's own id when it may be echoed."""

    def __init__(self, kind: str, message: str, request_id: str | None = None, cancel: str | None = None):
        super().__init__(message)
        self.kind, self.request_id, self.cancel = kind, request_id, cancel


@dataclass
class Line:
    number: int
    request: Request | None = None  # a request line: checked against the card, not yet submitted
    cancel: str | None = None  # a cancel line: the id to cancel


class JsonlServer:
    def __init__(self, engine: Engine, output_dir: str | Path, emit: Callable[[dict], None],
                 video_format: str = "gif", fps: int = 8, max_in_flight: int | None = None):  # fmt: skip
        """`max_in_flight` (default: 4x the engine's max_running) caps the requests taken into the
        engine; later request lines are held back, so a long input does not hold every request's
        loop state at once."""
        if video_format not in ("gif", "mp4"):
            raise ValueError(f"video_format={video_format!r} must be 'gif' or 'mp4'")
        check_video_output(f"video.{video_format}", fps)
        self.max_in_flight = 4 * engine.max_running if max_in_flight is None else max_in_flight
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be at least 1")
        self.engine = engine
        self.output_dir = Path(output_dir)
        self.emit = emit
        self.video_format = video_format
        self.fps = fps
        self._taken: dict[str, int] = {}  # every id a request took in this run -> its line

    def serve(self, lines: Iterable[str | bytes]) -> dict[str, int]:
        """Serve until `lines` ends and every request has come back; returns the count per answer
        (a request's status, or "cancel <status>")."""
        inbox: queue.Queue = queue.Queue()
        threading.Thread(target=_read, args=(lines, inbox), name="fvgraph-jsonl-reader", daemon=True).start()
        counts: dict[str, int] = {}
        backlog: deque[Line] = deque()  # request lines held back by max_in_flight
        ended = False
        while True:
            # Wait for input only when there is nothing to run; otherwise take what has arrived and tick.
            wait = not ended and not backlog and not self.engine.has_work()
            ended = self._take_arrived(inbox, wait, backlog, counts) or ended
            while backlog and self.engine.in_flight < self.max_in_flight:
                self._submit(backlog.popleft(), counts)
            if self.engine.has_work():
                for result in self.engine.tick():
                    self._report(result, counts)
            elif ended and not backlog:
                return counts

    def _take_arrived(self, inbox: queue.Queue, wait: bool, backlog: deque[Line], counts: dict) -> bool:
        """Read every line that has arrived: control lines act at once, requests join the backlog.
        Returns whether the input has ended."""
        while True:
            try:
                item = inbox.get(block=wait)
            except queue.Empty:
                return False
            wait = False
            if item is _END:
                return True
            number, raw = item
            try:
                line = self._parse(number, raw)
            except LineRejected as err:
                self._reject(number, err, counts)
                continue
            if line is None:
                continue
            if line.cancel is not None:
                self._cancel(line, backlog, counts)
            else:
                self._taken[_file_key(line.request.request_id)] = number
                backlog.append(line)

    def _parse(self, number: int, raw: str | bytes) -> Line | None:
        """The line as a checked request or cancel (None when blank); LineRejected names the rule broken."""
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as err:
            raise LineRejected("request", f"line {number}: not UTF-8 text ({err})") from None
        if not text.strip():
            return None
        try:
            fields = json.loads(text)
        except (ValueError, RecursionError) as err:  # also too deep, or a number past the int limit
            raise LineRejected("request", f"line {number}: not JSON ({_cut(str(err))})") from None
        if not isinstance(fields, dict):
            raise LineRejected("request", f"line {number}: line: must be a JSON object, got {type(fields).__name__}")
        if "cancel" in fields:
            return Line(number, cancel=self._cancel_target(number, fields))
        own_id = fields.get("request_id")
        own_id = own_id if isinstance(own_id, str) and SAFE_ID.fullmatch(own_id) else None
        if own_id is not None and _file_key(own_id) in self._taken:
            raise LineRejected("request", f"line {number}: request_id: {own_id!r} was already used on line "
                                          f"{self._taken[_file_key(own_id)]} of this input (an id names its output "
                                          "file; ids differing only in case name the same file on some file systems); "
                                          "use a new one")  # fmt: skip
        try:
            request = Request.model_validate(fields)
            if not SAFE_ID.fullmatch(request.request_id):
                raise RequestRejected("request_id", f"{shown(request.request_id)} must be 1-{MAX_REQUEST_ID_LENGTH} of "
                                                    "A-Z a-z 0-9 _ . - and not start with '.' (it names the output file)")  # fmt: skip
            request.resolve(self.engine.card, self.engine.facts)  # the card's rules, checked now; the state is built at submit
        except ValidationError as err:
            errors = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {_cut(e['msg'])}"
                               for e in err.errors(include_input=False))  # fmt: skip
            raise LineRejected("request", f"line {number}: {_cut(errors, 1000)}", own_id) from None
        except RequestRejected as err:
            raise LineRejected("request", f"line {number}: {err}", own_id) from None
        except Exception as err:  # whatever else a hostile line finds: rejected alone, the server serves on
            raise LineRejected("request", f"line {number}: could not be read ({type(err).__name__}: {shown(str(err))})",
                               own_id) from None  # fmt: skip
        return Line(number, request=request)

    @staticmethod
    def _cancel_target(number: int, fields: dict) -> str:
        target = fields["cancel"]
        valid = isinstance(target, str) and 0 < len(target) <= MAX_REQUEST_ID_LENGTH
        if set(fields) != {"cancel"} or not valid:
            rule = "holds only the id to cancel" if valid else f"names a request id (1-{MAX_REQUEST_ID_LENGTH} characters)"
            raise LineRejected("cancel", f"line {number}: cancel: a cancel line {rule}", cancel=target if valid else None)
        return target

    def _cancel(self, line: Line, backlog: deque[Line], counts: dict) -> None:
        held = next((held for held in backlog if held.request.request_id == line.cancel), None)
        if held is not None:  # never reached the engine: it ends here
            backlog.remove(held)
            self._report(Result(line.cancel, "cancelled", seed=held.request.seed), counts)
            status = "accepted"
        else:
            status = "accepted" if self.engine.cancel(line.cancel) else "not_in_flight"
        if status != "accepted":
            log.warning("line %d: cancel %s: no such request in flight", line.number, shown(line.cancel))
        self._answer({"line": line.number, "kind": "cancel", "cancel": line.cancel, "request_id": None,
                      "status": status, "error": None}, counts)  # fmt: skip

    def _submit(self, line: Line, counts: dict) -> None:
        try:
            self.engine.submit(line.request)
        except Exception as err:  # the card's rules were checked when it was read: this is rare
            del self._taken[_file_key(line.request.request_id)]  # never ran: the id may be used again
            self._reject(line.number, LineRejected("request", f"line {line.number}: {err}", line.request.request_id), counts)

    def _reject(self, number: int, err: LineRejected, counts: dict) -> None:
        log.warning("line %d rejected: %s", number, err)
        if err.kind == "cancel":
            answer = {"line": number, "kind": "cancel", "cancel": err.cancel, "request_id": None, "status": "rejected",
                      "error": str(err)}  # fmt: skip
        else:
            answer = {"line": number, "kind": "request", "request_id": err.request_id, "status": "rejected", "seed": None,
                      "error": str(err), "timings": {}, "output": None}  # fmt: skip
        self._answer(answer, counts)

    def _report(self, result: Result, counts: dict) -> None:
        answer = {"line": self._taken.get(_file_key(result.request_id)), "kind": "request", "request_id": result.request_id,
                  "status": result.status, "seed": result.seed, "error": result.error,
                  "timings": {k: round(v, 6) for k, v in result.timings.items()}, "output": None}  # fmt: skip
        if result.cache is not None:  # step caching (docs/step_caching.md): what it did
            answer["cache"] = result.cache
        if result.ok:
            try:
                answer["output"] = str(self._write(result))
            except Exception as err:  # the request ran; its output could not be kept
                answer["status"], answer["error"] = "failed", f"writing the output: {err}"
        self._answer(answer, counts)

    def _answer(self, answer: dict, counts: dict) -> None:
        key = answer["status"] if answer["kind"] == "request" else f"cancel {answer['status']}"
        counts[key] = counts.get(key, 0) + 1
        self.emit(answer)

    def _write(self, result: Result) -> Path:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if result.frames is not None:
            return write_video(result.frames, self.output_dir / f"{result.request_id}.{self.video_format}", fps=self.fps)
        path = self.output_dir / f"{result.request_id}.safetensors"
        save_file({"latents": result.latents.contiguous()}, str(path))
        return path


def _read(lines: Iterable[str | bytes], inbox: queue.Queue) -> None:
    """The reader thread: every line into `inbox`, then the end marker, whatever happens."""
    number = 0
    try:
        for number, line in enumerate(lines, start=1):
            inbox.put((number, line))
    except Exception as err:  # the input itself failed (a closed pipe, a disk error): serve what was read
        log.error("reading the requests failed after line %d, serving what was read: %r", number, err)
    finally:
        inbox.put(_END)


class StdoutLines:
    """Prints each answer as one JSON line. When the reader goes away (`fvgraph serve | head -1`),
    printing stops, the rest of standard output goes to the null device, and serving carries on:
    outputs are still written and the summary still goes to standard error."""

    def __init__(self) -> None:
        self.closed = False

    def __call__(self, answer: dict) -> None:
        if self.closed:
            return
        try:
            print(json.dumps(answer), flush=True)
        except BrokenPipeError:
            self.closed = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's own flush at exit cannot fail either
            os.close(devnull)
            log.warning("standard output was closed: no more result lines are printed; outputs are still written")
