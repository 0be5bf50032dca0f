"""A JSON-lines serving front end: requests in, one result line per request out, as each one ends.

    {"prompt": "a red fox", "seed": 1, "request_id": "fox"}        a request: Request's fields, no tensors
    {"cancel": "fox"}                                             cancel a request in flight

Lines are read on a thread of their own, so a request that arrives while others are mid-run joins
them at the next tick (Engine.submit / tick). Every request gets exactly one result line:

    {"request_id": "fox", "status": "ok", "seed": 1, "error": null, "timings": {...}, "output": "out/fox.gif"}

A line that is not a valid request comes back at once as "rejected", naming the line, the field
and the rule; the requests in flight carry on. Videos are written as `<request_id>.gif` (or .mp4),
latents (output_type "latent") as `<request_id>.safetensors`. At the end of the input the server
finishes what is in flight and returns.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from pydantic import ValidationError
from safetensors.torch import save_file

from fvgraph.engine import Engine
from fvgraph.request import Request, RequestRejected, Result
from fvgraph.video_io import write_video

log = logging.getLogger(__name__)
# request_id becomes a file name: no separators, no leading dot.
SAFE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_END = object()


class JsonlServer:
    def __init__(self, engine: Engine, output_dir: str | Path, emit: Callable[[dict], None],
                 video_format: str = "gif", fps: int = 8, max_in_flight: int | None = None):  # fmt: skip
        """`max_in_flight` (default: 4x the engine's max_running) caps the requests taken into the
        engine; later lines wait as text, so a long input does not hold every request's state at once."""
        if video_format not in ("gif", "mp4"):
            raise ValueError(f"video_format={video_format!r} must be 'gif' or 'mp4'")
        self.max_in_flight = 4 * engine.max_running if max_in_flight is None else max_in_flight
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be at least 1")
        self.engine = engine
        self.output_dir = Path(output_dir)
        self.emit = emit
        self.video_format = video_format
        self.fps = fps

    def serve(self, lines: Iterable[str]) -> dict[str, int]:
        """Serve until `lines` ends and every request has come back; returns the count per status."""
        inbox: queue.Queue = queue.Queue()

        def read() -> None:
            try:
                for number, line in enumerate(lines, start=1):
                    inbox.put((number, line))
            finally:
                inbox.put(_END)

        threading.Thread(target=read, name="fvgraph-jsonl-reader", daemon=True).start()
        counts: dict[str, int] = {}
        ended = False
        while not ended or self.engine.has_work():
            # Wait for input only when there is nothing to run; otherwise take what has arrived and tick.
            while not ended and self.engine.in_flight < self.max_in_flight:
                try:
                    item = inbox.get(block=not self.engine.has_work())
                except queue.Empty:
                    break
                if item is _END:
                    ended = True
                else:
                    rejected = self._take(*item)
                    if rejected is not None:
                        self._report(rejected, counts)
            if self.engine.has_work():
                for result in self.engine.tick():
                    self._report(result, counts)
        return counts

    def _take(self, number: int, line: str) -> Result | None:
        """Submit or cancel what the line asks; a line that cannot be served comes back as a rejected Result."""
        if not line.strip():
            return None
        request_id = f"line-{number}"
        try:
            fields = json.loads(line)
            if not isinstance(fields, dict):
                raise RequestRejected("line", f"must be a JSON object, got {type(fields).__name__}")
            request_id = str(fields.get("request_id", fields.get("cancel", request_id)))
            if "cancel" in fields:
                if set(fields) != {"cancel"}:
                    raise RequestRejected("cancel", "a cancel line holds only the id to cancel")
                if not self.engine.cancel(request_id):
                    log.warning("line %d: cancel %r: no such request in flight", number, request_id)
                return None
            request = Request.model_validate(fields)
            if not SAFE_ID.fullmatch(request.request_id):
                raise RequestRejected("request_id", f"{request.request_id!r} must be 1-128 of A-Z a-z 0-9 _ . - "
                                                    "and not start with '.' (it names the output file)")  # fmt: skip
            self.engine.submit(request)
            return None
        except json.JSONDecodeError as err:
            error = f"line {number}: not JSON ({err})"
        except ValidationError as err:
            error = f"line {number}: " + "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in err.errors()
            )
        except RequestRejected as err:
            error = f"line {number}: {err}"
        log.warning("request %s rejected: %s", request_id, error)
        return Result(request_id, "rejected", error=error)

    def _report(self, result: Result, counts: dict[str, int]) -> None:
        line = {"request_id": result.request_id, "status": result.status, "seed": result.seed, "error": result.error,
                "timings": {k: round(v, 6) for k, v in result.timings.items()}, "output": None}  # fmt: skip
        if result.ok:
            try:
                line["output"] = str(self._write(result))
            except (OSError, ValueError) as err:  # the request ran; its output could not be kept
                line["status"], line["error"] = "failed", f"writing the output: {err}"
        counts[line["status"]] = counts.get(line["status"], 0) + 1
        self.emit(line)

    def _write(self, result: Result) -> Path:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if result.frames is not None:
            return write_video(result.frames, self.output_dir / f"{result.request_id}.{self.video_format}", fps=self.fps)
        path = self.output_dir / f"{result.request_id}.safetensors"
        save_file({"latents": result.latents.contiguous()}, str(path))
        return path
