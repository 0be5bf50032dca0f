"""AsyncEngine: an Engine served from asyncio. The engine ticks on a thread of its own; nothing else touches it.

    async with AsyncEngine(engine) as served:
        result = await served.generate(Request(prompt="a fox"))
        async for event in served.stream(Request(prompt="the sea")):   # queued, started, step..., done
            print(event.kind, event.step, event.total)
        await served.cancel(request_id)

`submit` checks a request against the card and the admission queue at once (RequestRejected: 400;
QueueFull: 429; EngineClosed: 503, also while the engine sleeps: `sleep` / `wake`) and never blocks.
Everything else reaches the engine thread as a command (fvgraph/serving/engine_commands.py: a frozen
dataclass each, dispatched by type); the thread admits requests as memory frees
(fvgraph.serving.admission), ticks the engine, cancels requests whose deadline passed, and sends each
request's events (fvgraph.serving.request_events) back to the event loop, where listeners (the HTTP
front end's store and metrics) and per-request subscribers see them in order. Every accepted request
ends with exactly one terminal event, whose Result's
`timings["total"]` runs from acceptance (time spent waiting for memory counts) to the end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fvgraph.serving.admission import Admission
from fvgraph.engine.engine import Engine
from fvgraph.engine.sleep import EngineAsleep, RequestsInFlight
from fvgraph.serving.engine_commands import Accepted, Call, Cancel, EngineCommand, Refused, Sleep, Stop, Wake, Warmup
from fvgraph.serving.memory_reservation import MemoryModel, default_budget
from fvgraph.events import DecodedFrames
from fvgraph.request import Request, RequestRejected, Result
from fvgraph.serving.media_encode import encode_image
from fvgraph.serving.request_events import CancelReason, RequestEvent
from fvgraph.serving.wait_events import WaitRelay

log = logging.getLogger(__name__)
Listener = Callable[[RequestEvent], None]
BatchListener = Callable[[str, int, float], None]  # (step kind, requests in the batch, seconds it took)
FrameListener = Callable[[DecodedFrames], None]
_TERMINAL_KIND = {"ok": "done", "failed": "failed", "rejected": "failed", "cancelled": "cancelled"}


class EngineClosed(RuntimeError):
    """The engine is draining or stopped: it takes no new requests."""


class AsyncEngine:
    def __init__(self, engine: Engine, admission: Admission | None = None, max_queue: int = 256,
                 idle_wait_s: float = 0.05):  # fmt: skip
        """`admission` defaults to the device's default budget (fvgraph.serving.memory_reservation) and a queue
        of `max_queue`. `idle_wait_s` is how often an idle engine thread checks deadlines."""
        self.engine = engine
        self.admission = admission or Admission(
            MemoryModel(engine), default_budget(engine), max_queue, engine.max_running
        )
        self.listeners: list[Listener] = []
        self.batch_listeners: list[BatchListener] = []
        self.frame_listeners: list[FrameListener] = []  # a video's frames as they decode (events.DecodedFrames)
        self.accepting = False
        self.asleep: int | None = None  # the sleep level, set as soon as a sleep begins (requests are refused)
        self.error: BaseException | None = None  # set if the engine thread died
        self._idle_wait_s = idle_wait_s
        self._commands: queue.Queue[EngineCommand] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._known: set[str] = set()  # accepted and not yet ended (event-loop side)
        self._subscribers: dict[str, list[asyncio.Queue]] = {}
        self._history: dict[str, list[RequestEvent]] = {}  # each known request's events so far, for a late subscriber
        self._idle = asyncio.Event()
        # engine-thread side only
        self._deadlines: dict[str, float] = {}
        self._accepted_at: dict[str, float] = {}
        self._reasons: dict[str, CancelReason] = {}
        self._in_engine: set[str] = set()
        self._started: set[str] = set()
        self._phase_seconds: dict[str, dict[str, float]] = {}
        self._stopping = False
        # The engine thread's long waits (compiles) as `wait` events of the requests in it (wait_events.py).
        self._waits = WaitRelay(lambda: self._thread, lambda: tuple(self._in_engine), self._send)

    # -- life cycle (event loop) -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and accept requests."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="fvgraph-engine", daemon=True)
        self._waits.attach()
        self._thread.start()
        self.accepting = True

    async def warmup(self, requests: Sequence[Request]) -> None:
        """Run Engine.warmup on the engine thread (compile or load every bucket of these requests'
        shapes, then refuse recompiles); requests accepted meanwhile wait until it is done."""
        if requests:
            done: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(Warmup(tuple(requests), done))
            await asyncio.wrap_future(done)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """`fn(engine)` on the engine thread, between two ticks (loading or unloading an adapter); its
        exception is raised here."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(Call(fn, done))
        return await asyncio.wrap_future(done)

    async def sleep(self, level: int = 1, in_flight: str = "finish") -> dict:
        """Engine.sleep (fvgraph/engine/sleep.py) on the engine thread. New requests are refused (EngineClosed,
        naming sleep) from now on; those accepted first end as `in_flight` says: "finish" lets them run to
        their end (those still waiting for memory too), "stop" cancels them (reason 'sleep'), "refuse"
        raises while any is in flight, changing nothing."""
        if in_flight not in ("finish", "stop", "refuse"):
            raise ValueError(f"in_flight={in_flight!r} must be 'finish', 'stop' or 'refuse'")
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"level={level!r} must be 1 (weights to host memory) or 2 (weights discarded)")
        if self.asleep is not None:
            raise EngineAsleep(f"the engine is already asleep (sleep level {self.asleep}); wake it before sleeping again")
        if in_flight == "refuse" and self._known:
            raise RequestsInFlight(f"sleep(in_flight='refuse'): {len(self._known)} requests are in flight; let them end, "
                               "or sleep with in_flight='finish' or 'stop'")  # fmt: skip
        self.asleep = level
        try:
            if in_flight == "stop":
                for request_id in list(self._known):
                    await self.cancel(request_id, reason="sleep")
            await self._idle.wait()  # every accepted request has ended and its events are out
            done: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(Sleep(level, done))
            return await asyncio.wrap_future(done)
        except BaseException:
            self.asleep = None
            raise

    async def wake(self) -> dict:
        """Engine.wake on the engine thread; requests are accepted again once it returns."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(Wake(done))
        answer = await asyncio.wrap_future(done)
        self.asleep = None
        return answer

    async def drain(self, timeout_s: float) -> None:
        """Take no new requests; let those accepted end for up to `timeout_s`, then cancel the rest
        (reason 'shutdown') and wait for their terminal events."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            for request_id in list(self._known):
                await self.cancel(request_id, reason="shutdown")
            await self._idle.wait()

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        """Drain (by default cancelling whatever is still in flight at once) and stop the engine thread."""
        if self._thread is None:
            return
        await self.drain(drain_timeout_s)
        self._commands.put(Stop())
        await asyncio.to_thread(self._thread.join)
        self._waits.detach()
        self._thread = None

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- requests (event loop) ---------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._known)

    def knows(self, request_id: str) -> bool:
        """Whether the request was accepted and has not ended."""
        return request_id in self._known

    def submit(self, request: Request, timeout_s: float | None = None) -> str:
        """Accept `request` (queued event) or raise: RequestRejected (what the loop's `check_request`
        refuses, or can never fit the memory budget), QueueFull, EngineClosed. `timeout_s` cancels it
        that long after now."""
        if not self.accepting or self.error is not None:
            raise EngineClosed("the server is shutting down and takes no new requests" if self.error is None
                               else f"the engine stopped: {self.error!r}")  # fmt: skip
        if self.asleep is not None:
            raise EngineClosed(f"the engine is asleep (sleep level {self.asleep}): it takes requests again after wake "
                               "(POST /v1/admin/wake, or AsyncEngine.wake)")  # fmt: skip
        if self.engine.unavailable is not None:  # a parallel engine that lost a worker rank: 503, not 500
            raise EngineClosed(f"the engine takes no new requests: {self.engine.unavailable}")
        if request.request_id in self._known:
            raise RequestRejected("request_id", f"{request.request_id!r} is already in flight")
        if timeout_s is not None and not timeout_s > 0:
            raise RequestRejected("timeout", f"{timeout_s} must be a positive number of seconds")
        # Everything the engine would refuse, refused now (400), not after it was accepted: the card's
        # limits, the loop's own rules (an image-to-video card needs an image), step caching.
        resolved = self.engine.loop.check_request(request)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # The thread learns of the request before admission can hand it over, so its deadline and
        # start time are known when it enters the engine.
        self._commands.put(Accepted(resolved.request_id, deadline, time.perf_counter()))
        try:
            self.admission.offer(resolved)
        except BaseException:
            self._commands.put(Refused(resolved.request_id))
            raise
        self._known.add(resolved.request_id)
        self._idle.clear()
        self._deliver([RequestEvent(resolved.request_id, "queued")])
        return resolved.request_id

    def subscribe(self, request_id: str) -> asyncio.Queue:
        """A queue that receives this request's events, up to and including its terminal one: those
        it already had (a client that asks after submitting misses none: a fast first step), then the
        rest as they come."""
        events: asyncio.Queue = asyncio.Queue()
        for event in self._history.get(request_id, ()):
            events.put_nowait(event)
        self._subscribers.setdefault(request_id, []).append(events)
        return events

    def unsubscribe(self, request_id: str, events: asyncio.Queue) -> None:
        subscribers = self._subscribers.get(request_id, [])
        if events in subscribers:
            subscribers.remove(events)
        if not subscribers:
            self._subscribers.pop(request_id, None)

    async def stream(self, request: Request, timeout_s: float | None = None) -> AsyncIterator[RequestEvent]:
        """Submit and yield every event of the request, ending with its terminal one."""
        events = self.subscribe(request.request_id)
        try:
            self.submit(request, timeout_s)
            while True:
                event = await events.get()
                yield event
                if event.terminal:
                    return
        finally:
            self.unsubscribe(request.request_id, events)

    async def generate(self, request: Request, timeout_s: float | None = None) -> Result:
        """Submit and wait for the request's Result (status ok, failed or cancelled)."""
        async for event in self.stream(request, timeout_s):
            if event.terminal:
                return event.result
        raise AssertionError("unreachable: a stream ends with its terminal event")

    async def cancel(self, request_id: str, reason: CancelReason = "client") -> bool:
        """Cancel a request at its next step boundary (or at once while it waits for memory). False,
        changing nothing, for an id not in flight."""
        if request_id not in self._known:
            return False
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(Cancel(request_id, reason, answer))
        return await asyncio.wrap_future(answer)

    def _deliver(self, events: list[RequestEvent]) -> None:
        """On the event loop: hand each event to the listeners and the request's subscribers."""
        for event in events:
            for listener in self.listeners:
                try:
                    listener(event)
                except Exception:  # a listener's bug must not lose other requests' events
                    log.exception("event listener failed on %s %s", event.request_id, event.kind)
            for events_queue in self._subscribers.get(event.request_id, []):
                events_queue.put_nowait(event)
            if event.terminal:
                self._known.discard(event.request_id)
                self._history.pop(event.request_id, None)
            elif event.request_id in self._known:
                self._history.setdefault(event.request_id, []).append(event)
        if not self._known:
            self._idle.set()

    def _send(self, events: list[RequestEvent]) -> None:
        """From the engine thread to the event loop."""
        if events:
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver_frames(self, decoded: list[DecodedFrames]) -> None:
        for frames in decoded:
            for listener in self.frame_listeners:
                try:
                    listener(frames)
                except Exception:  # one video's stream failing must not stop the others'
                    log.exception("frame listener failed on %s", frames.request_id)

    def _deliver_batches(self, batches: list[tuple[str, int, float]]) -> None:
        for batch in batches:
            for listener in self.batch_listeners:
                try:
                    listener(*batch)
                except Exception:
                    log.exception("batch listener failed")

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_work() or self.admission.queue_depth > 0
                self._take_commands(block=not busy)
                if self._stopping and not self.engine.has_work():
                    return
                self._expire_deadlines()
                for request in self.admission.admit():
                    self._enter(request)
                if self.engine.has_work():
                    self._tick()
        except BaseException as err:  # the engine is unusable: every request in flight fails, and says why
            log.exception("the engine thread stopped")
            self.error = err
            self._loop.call_soon_threadsafe(self._fail_all, repr(err))

    def _fail_all(self, error: str) -> None:
        self._deliver([RequestEvent(rid, "failed", error=error, result=Result(rid, "failed", error=error))
                       for rid in list(self._known)])  # fmt: skip

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: EngineCommand) -> None:
        match command:
            case Accepted():
                self._accepted_at[command.request_id] = command.accepted_at
                if command.deadline is not None:
                    self._deadlines[command.request_id] = command.deadline
            case Refused():
                self._deadlines.pop(command.request_id, None)
                self._accepted_at.pop(command.request_id, None)
            case Cancel():
                cancelled = self._cancel(command.request_id, command.reason)
                if command.answer.set_running_or_notify_cancel():  # False: the caller stopped waiting (its task was cancelled)
                    command.answer.set_result(cancelled)
            case Warmup():
                self._answer(command.done, lambda: self.engine.warmup(list(command.requests)))
            case Call():
                self._answer(command.done, lambda: command.fn(self.engine))
            case Sleep():  # nothing is in flight: AsyncEngine.sleep waited for that
                self._answer(command.done, lambda: self.engine.sleep(command.level, in_flight="refuse"))
            case Wake():
                self._answer(command.done, self.engine.wake)
            case Stop():
                self._stopping = True
            case _:
                raise TypeError(f"the engine thread got {command!r}, not an engine command (fvgraph/serving/engine_commands.py)")

    @staticmethod
    def _answer(done: concurrent.futures.Future, run: Callable[[], Any]) -> None:
        """Run `run` and set `done` to its result or exception; nothing when the caller stopped waiting
        (or the server stopped before a warmup began)."""
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(run())
        except Exception as err:
            done.set_exception(err)

    def _cancel(self, request_id: str, reason: CancelReason) -> bool:
        if self.admission.withdraw(request_id):  # still waiting for memory: it ends now
            self._end(Result(request_id, "cancelled"), reason)
            return True
        if request_id in self._in_engine:
            self._reasons.setdefault(request_id, reason)
            return self.engine.cancel(request_id)
        return False

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for request_id in [rid for rid, deadline in self._deadlines.items() if deadline <= now]:
            del self._deadlines[request_id]
            self._cancel(request_id, "timeout")

    def _enter(self, request: Request) -> None:
        try:
            self.engine.submit(request)
            self._in_engine.add(request.request_id)
        except Exception as err:  # RequestRejected: the engine refused what the card check passed
            self._end(Result(request.request_id, "failed", seed=request.seed, error=str(err)))

    def _tick(self) -> None:
        steps: list[tuple[str, str, int, int, float]] = []

        kinds, take_preview, previews = self.engine.loop.step_kinds, self.engine.loop.take_preview, {}
        take_frames, frames, listen_frames = self.engine.loop.take_frames, [], bool(self.frame_listeners)

        def on_step(state, kind: str) -> None:
            phase = kinds[kind].phase
            seen = self._phase_seconds.setdefault(state.request_id, {})
            spent = state.timings.get(phase, 0.0)
            preview = take_preview(state)  # Request.preview_every: sent right after its step's event
            if preview is not None:
                previews[len(steps)] = RequestEvent(preview.request_id, "preview", step=preview.step, total=preview.total,
                                                    image_png=encode_image(preview.image, "png"))  # fmt: skip
            steps.append((state.request_id, kind, state.step_index, state.num_steps, spent - seen.get(phase, 0.0)))
            if listen_frames and (decoded := take_frames(state)) is not None:  # a decode step's frames (a video stream)
                frames.append(decoded)
            seen[phase] = spent

        results = self.engine.tick(on_step)
        # The members of one batch come one after another with the same kind and the same time.
        batches: list[list] = []
        for _, kind, _, _, seconds in steps:
            if batches and batches[-1][0] == kind and batches[-1][2] == seconds:
                batches[-1][1] += 1
            else:
                batches.append([kind, 1, seconds])
        rows = {(kind, seconds): n for kind, n, seconds in batches}
        events = []
        for position, (request_id, kind, index, total, seconds) in enumerate(steps):
            batch = rows[(kind, seconds)]
            if request_id not in self._started:
                self._started.add(request_id)
                self.admission.started(request_id)
                events.append(RequestEvent(request_id, "started"))
            denoise = kinds[kind].per_inference_step
            events.append(RequestEvent(request_id, "step", step=index if denoise else None, total=total if denoise else None,
                                       step_kind=kind, step_seconds=seconds, batch=batch))  # fmt: skip
            if position in previews:
                events.append(previews[position])
        self._send(events)
        if frames:  # after the step events, before any end: a video's last frames precede its `done`
            self._loop.call_soon_threadsafe(self._deliver_frames, frames)
        if batches and self.batch_listeners:
            self._loop.call_soon_threadsafe(self._deliver_batches, [tuple(b) for b in batches])
        for result in results:
            self._end(result, self._reasons.pop(result.request_id, "client"))

    def _end(self, result: Result, reason: CancelReason = "client") -> None:
        request_id = result.request_id
        self.admission.release(request_id)
        for owned in (self._in_engine, self._started):
            owned.discard(request_id)
        self._deadlines.pop(request_id, None)
        self._phase_seconds.pop(request_id, None)
        accepted_at = self._accepted_at.pop(request_id, None)
        if accepted_at is not None:  # from acceptance, not from entering the engine: waiting counts too
            result.timings["total"] = time.perf_counter() - accepted_at
        kind = _TERMINAL_KIND[result.status]
        self._send([RequestEvent(request_id, kind, error=result.error, result=result,
                                 reason=reason if kind == "cancelled" else None)])  # fmt: skip
