"""The HTTP API of `fvgraph serve --port`: OpenAI's videos and images endpoints on an AsyncEngine.

    POST   /v1/videos                     create (multipart form as the OpenAI SDK sends it, or JSON)
    GET    /v1/videos                     list, newest first (after, limit, order)
    GET    /v1/videos/{id}                the Video object
    GET    /v1/videos/{id}/content        the mp4; ?variant=thumbnail: a JPEG of the first frame,
                                          ?variant=spritesheet: a JPEG of every frame in a grid;
                                          ?stream=true: fragmented mp4 as it decodes (http_video_stream.py)
    POST   /v1/videos/{id}/remix          a new video: a new prompt on a completed video's settings
    GET    /v1/videos/{id}/events         Server-Sent Events: started, one per step, the end, the final Video
    DELETE /v1/videos/{id}                cancel at the next step boundary and delete the content
    POST   /v1/images/generations         one frame through the same engine; b64_json or a URL
    POST   /v1/images/edits               the same from an uploaded image, on an image-editing card
    GET    /v1/images/{id}/content        the PNG (JPEG, WebP) behind such a URL
    GET    /v1/models, /v1/models/{name}  the names `model` may give (fvgraph/serving/model_names.py)
    GET/POST /v1/loras, DELETE /v1/loras/{name}   the LoRA adapters (fvgraph/serving/http_adapters.py)
    GET    /health, /ready, /metrics      liveness, readiness (warm), Prometheus metrics
    GET    /, /v1/playground/config       the playground page and what it shows (fvgraph/serving/http_playground.py)

Every GET route answers HEAD too (the same headers, no body). Errors are OpenAI-shaped:
{"error": {"message", "type", "param", "code"}}; `param` names the field the client sent
(fvgraph/serving/http_errors.py, fvgraph/serving/http_error_shape.py). Downloads carry an ETag
(fvgraph/serving/http_content.py); CORS is fvgraph/serving/http_cors.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from fvgraph.serving.async_engine import AsyncEngine, EngineClosed
from fvgraph.serving.client_fields import named_as_sent
from fvgraph.serving.http_adapters import ADAPTER_ROUTES, AdapterApi
from fvgraph.serving.http_admin import ADMIN_ROUTES, AdminApi
from fvgraph.serving.http_content import etag, file_download
from fvgraph.serving.http_cors import add_cors, check_origins
from fvgraph.serving.http_error_shape import OpenAiErrorShape
from fvgraph.serving.http_errors import ApiError, error_handlers
from fvgraph.serving.http_guard import HttpGuard
from fvgraph.serving.http_images import ImageRoutes
from fvgraph.serving.http_playground import PLAYGROUND_ROUTES, PlaygroundApi
from fvgraph.serving.http_same_origin import SameOriginGuard
from fvgraph.serving.http_video_stream import stream_flag, streamed_mp4
from fvgraph.serving.media_encode import encode_image, encode_mp4, encode_spritesheet
from fvgraph.serving.model_names import MODEL_ROUTES, ModelsApi, ServedNames
from fvgraph.serving.openai_requests import (
    Parsed,
    VideoBody,
    MAX_REFERENCE_PIXELS,
    check_input_reference,
    json_fields,
    nested_form_fields,
    parse_body,
    video_request,
)
from fvgraph.request import Request, RequestRejected
from fvgraph.serving.request_events import RequestEvent
from fvgraph.serving.serving_metrics import ServingMetrics
from fvgraph.serving.video_remix import RemixBody, remix_request, remix_settings, with_seed
from fvgraph.serving.video_store import StoredVideo, VideoStore
from fvgraph.serving.video_streams import VideoStreams
from fvgraph.serving.video_upload import decode_video_upload, is_video_upload

log = logging.getLogger(__name__)
CONTENT_TYPES = {"video": "video/mp4", "thumbnail": "image/jpeg", "spritesheet": "image/jpeg"}  # ?variant=
CANCELLED = {  # what a video cancelled by the server says, by reason (a client's DELETE removes the video)
    "timeout": "cancelled when its timeout passed (field timeout)",
    "shutdown": "cancelled: the server shut down before it finished",
    "sleep": "cancelled: the engine was put to sleep (POST /v1/admin/sleep) before it finished",
}


@dataclass(frozen=True)
class HttpSettings:
    """What `fvgraph serve --port` configures besides the engine."""

    api_key: str | None = None  # Bearer key every /v1 and /metrics call must carry; None: open
    admin_api_key: str | None = None  # the one key of the admin actions (adapters, sleep; http_guard.py); None: the API key
    max_body_bytes: int = 16 << 20  # larger request bodies get 413
    max_prompt_chars: int = 20_000
    retention_s: float = 3600.0  # finished videos and their files are deleted this long after they end
    drain_timeout_s: float = 30.0  # on shutdown, running requests get this long before they are cancelled
    warmup: tuple[Request, ...] = ()  # run through Engine.warmup before /ready says ready
    model_names: ServedNames | None = None  # what `model` may name; None: the card id only
    allowed_origins: tuple[str, ...] = ()  # web origins that may call the API (CORS); "*": any; (): none
    playground: bool = True  # serve the playground page at / (fvgraph serve --no-playground: off, / is a 404)
    # Host names answered (http_same_origin.py; None: any). `fvgraph serve` derives them from its bind
    # address: the loopback names on a loopback address, plus --allowed-hosts.
    allowed_hosts: tuple[str, ...] | None = None
    lora_dir: Path | None = None  # where POST /v1/loras may load adapter files from; None: loading over HTTP is refused

    def __post_init__(self):
        object.__setattr__(self, "allowed_origins", check_origins(self.allowed_origins))


class VideoApi(ImageRoutes):
    """The endpoints and what they share: the served engine, the store, the metrics, ready / draining."""

    def __init__(self, served: AsyncEngine, store: VideoStore, settings: HttpSettings):
        self.served, self.store, self.settings = served, store, settings
        self.card, self.facts = served.engine.card, served.engine.facts  # limits; what the weights say
        self.metrics = ServingMetrics(served)
        self.names = settings.model_names or ServedNames(self.card.card_id)
        self.ready = False
        self.draining = False
        self._encodes: set[asyncio.Task] = set()
        served.listeners.append(self.track)
        self.streams = VideoStreams()  # each video's fragmented mp4 while it decodes
        served.listeners.append(self.streams.track)
        served.frame_listeners.append(lambda frames: self.streams.frames(frames, self._video_fps(frames.request_id)))

    # -- life cycle --------------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await self.served.start()
        background = [asyncio.ensure_future(self._expire_loop()), asyncio.ensure_future(self._warm())]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await self.drain()
            await self.served.close()

    async def _warm(self) -> None:
        """Compile (or load) the warmup shapes before /ready says ready; requests that arrive first wait."""
        try:
            await self.served.warmup(self.settings.warmup)
        except Exception:
            log.exception("warmup failed; the server stays not ready")
            return
        self.metrics.ready(self.served.engine.counters.compiles)
        self.ready = True

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.settings.retention_s / 4))
            self.store.expire()

    async def drain(self) -> None:
        """Refuse new requests (503), let the running ones end (up to the drain timeout), then cancel
        the rest and wait for every video's file to be written or its failure recorded."""
        self.draining = True
        await self.served.drain(self.settings.drain_timeout_s)
        while self._encodes:
            await asyncio.gather(*list(self._encodes), return_exceptions=True)

    # -- each video's status, from its engine events -----------------------------------------------

    def track(self, event: RequestEvent) -> None:
        item = self.store.get(event.request_id)
        if item is None or item.object != "video":
            return
        if event.kind == "started":
            self.store.update(item.id, status="in_progress")
        elif event.kind == "step" and event.total:
            self.store.update(item.id, progress=min(99, int(100 * event.step / event.total)))
        elif event.kind == "done":
            task = asyncio.ensure_future(self._finish_video(event, item))
            self._encodes.add(task)
            task.add_done_callback(self._encodes.discard)
        elif event.kind == "failed":
            self.store.finish(item.id, "failed", {"code": "generation_failed", "message": event.error or "failed"})
        elif event.kind == "cancelled":
            self.store.finish(item.id, "failed", {"code": event.reason, "message": CANCELLED.get(event.reason, "cancelled")})

    async def _finish_video(self, event: RequestEvent, item: StoredVideo) -> None:
        """Encode and write the files on a worker thread (the event loop keeps serving meanwhile)."""
        frames = event.result.frames
        if item.settings is not None and event.result.seed is not None:  # a remix reuses the seed it ran with
            digests = event.result.provenance.get("lora_digests", {})
            self.store.update(item.id, settings=with_seed(item.settings, event.result.seed, digests))

        def encode_and_store() -> None:
            content = {"video": encode_mp4(frames, item.fps), "thumbnail": encode_image(frames[0], "jpeg"),
                       "spritesheet": encode_spritesheet(frames)}  # fmt: skip
            self.store.finish(item.id, "completed", content=content)

        try:
            await asyncio.to_thread(encode_and_store)
        except Exception as err:  # the request ran; its file could not be written
            log.exception("video %s: encoding failed", item.id)
            self.store.finish(item.id, "failed", {"code": "encoding_failed", "message": f"writing the mp4: {err!r}"})
        finally:  # from here on ?stream=true serves the stored file
            self.streams.drop(item.id)

    def _video_fps(self, request_id: str) -> float | None:
        item = self.store.get(request_id)
        return item.fps if item is not None and item.object == "video" else None

    # -- request bodies ----------------------------------------------------------------------------

    async def _fields(self, http: HttpRequest) -> dict:
        kind = http.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "application/json":
            return json_fields(await http.body())
        if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
            try:
                form = await http.form(max_part_size=self.settings.max_body_bytes)
            except HTTPException as err:  # no boundary, too many fields or files (1000), a part too large
                raise RequestRejected("body", f"is not a readable form: {err.detail}") from None
            fields = {}
            for name, value in form.multi_items():
                if name in fields:
                    raise RequestRejected(name, "is given twice")
                fields[name] = await value.read() if isinstance(value, UploadFile) else value
            return nested_form_fields(fields)
        raise RequestRejected("body", f"Content-Type {kind or '(none)'!r} must be multipart/form-data or application/json")

    def _accept(self, parsed: Parsed) -> None:
        if self.draining:
            raise EngineClosed("the server is shutting down and takes no new requests")
        with named_as_sent(parsed.sent_as, parsed.notes):  # `size: ...`, not `width: ...`
            self.served.submit(parsed.request, parsed.timeout)

    def _sized(self, parsed: Parsed) -> Parsed:
        """`parsed` with the size the served loop runs it at, where the client left that to the loop
        (HunyuanVideo-1.5 i2v: the image's bucket; Qwen-Image-Edit: the image's edit size)."""
        if parsed.size is not None:
            return parsed
        with named_as_sent(parsed.sent_as, parsed.notes):
            resolved = self.served.engine.loop.check_request(parsed.request)
        return replace(parsed, size=f"{resolved.width}x{resolved.height}")

    def _find(self, video_id: str) -> StoredVideo:
        item = self.store.get(video_id)
        if item is None or item.object != "video":
            raise ApiError(404, f"no video {video_id!r} (it never existed, was deleted, or expired)", "video_id", "not_found")
        return item

    # -- /v1/videos --------------------------------------------------------------------------------

    async def create_video(self, http: HttpRequest):
        fields = await self._fields(http)
        reference, image, video, cut = fields.pop("input_reference", None), None, None, None
        body = parse_body(VideoBody, fields)
        self.names.check(body.model)
        if body.user is not None:
            log.info("video for user %r (user is accepted and only logged)", body.user)
        if reference is not None:
            if not isinstance(reference, bytes):  # a URL or file id: fetching what a client names is not done here
                raise RequestRejected("input_reference", "must be the image or video itself, uploaded as a file in a "
                                                         "multipart form; this server fetches no URLs or file ids")  # fmt: skip
            reads = self.served.engine.loop.reads
            if is_video_upload(reference):
                if "video" not in reads:
                    raise RequestRejected("input_reference", f"card {self.card.card_id!r} takes no video; serve a Wan "
                                                             "text-to-video card for video-to-video")  # fmt: skip
                video, cut = await asyncio.to_thread(decode_video_upload, reference, self.card.shapes.max_frames,
                                                     MAX_REFERENCE_PIXELS, self.facts.temporal_multiple)  # fmt: skip
            else:
                image = check_input_reference(reference, self.card, "image" in reads)
        parsed = video_request(body, self.card, self.store.new_id("video"), self.settings.max_prompt_chars,
                               self.facts.temporal_multiple, image, video)  # fmt: skip
        if cut is not None:
            parsed.notes["video"] = cut
        return self._start_video(self._sized(parsed), None, body.model or self.card.card_id)

    async def remix_video(self, video_id: str, http: HttpRequest):
        source = self._find(video_id)
        body = parse_body(RemixBody, await self._fields(http))
        loaded = {a["name"]: a["digest"] for a in await self.served.call(lambda engine: engine.loras())}
        parsed = remix_request(source, body, self.names.accepts, self.store.new_id("video"), self.settings.max_prompt_chars,
                               loaded)  # fmt: skip
        return self._start_video(parsed, source.id, source.model)

    def _start_video(self, parsed: Parsed, remixed_from: str | None, model: str) -> dict:
        """Record the video under the model name the client used, then submit its request (a refusal
        removes the record again)."""
        request = parsed.request
        item = self.store.add(StoredVideo(request.request_id, "video", model, request.prompt, parsed.size,
                                          parsed.seconds, request.num_frames, parsed.fps, int(time.time()),
                                          remixed_from=remixed_from, settings=remix_settings(parsed)))  # fmt: skip
        try:
            self._accept(parsed)
        except Exception:
            self.store.remove(item.id)
            raise
        return item.to_json()

    async def list_videos(self, after: str | None = None, limit: int = 20, order: str = "desc"):
        if not 1 <= limit <= 100:
            raise RequestRejected("limit", f"{limit} must be between 1 and 100")
        if order not in ("asc", "desc"):
            raise RequestRejected("order", f"{order!r} must be 'asc' or 'desc'")
        try:
            items, has_more = self.store.page(after, limit, order)
        except KeyError:
            raise RequestRejected("after", f"{after!r} is not a video id in this list") from None
        data = [item.to_json() for item in items]
        return {"object": "list", "data": data, "has_more": has_more,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}  # fmt: skip

    async def get_video(self, video_id: str):
        return self._find(video_id).to_json()

    async def video_content(self, video_id: str, http: HttpRequest, variant: str = "video", stream: str | None = None):
        if variant not in CONTENT_TYPES:
            raise RequestRejected("variant", f"{variant!r} must be one of {', '.join(map(repr, CONTENT_TYPES))}")
        streamed = stream_flag(stream, variant)
        item = self._find(video_id)
        if streamed and (item.status in ("queued", "in_progress") or item.id in self.streams.live):
            return streamed_mp4(http, self.streams.open(item.id, item.fps))
        path = self.store.content(item.id, variant)
        if path is None and item.status == "completed":
            raise ApiError(404, f"video {video_id!r} has no {variant}: it was made before this server wrote them",
                           "variant", "not_found")  # fmt: skip
        if path is None:
            raise ApiError(404, f"video {video_id!r} is {item.status}: its content exists once it is completed",
                           "video_id", "not_ready")  # fmt: skip
        return file_download(http, path, CONTENT_TYPES[variant], etag(item.id, variant))

    async def video_events(self, video_id: str, http: HttpRequest):
        item = self._find(video_id)
        if http.method == "HEAD":  # the stream's headers; the stream itself would run until the video ends
            return Response(media_type="text/event-stream", headers={"Cache-Control": "no-store"})
        events = self.served.subscribe(item.id)  # before the snapshot: no event falls between the two
        return StreamingResponse(self._event_stream(item.id, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})  # fmt: skip

    async def _event_stream(self, video_id: str, events: asyncio.Queue):
        """The Video now, its events up to the end, then the Video once its file is written."""
        try:
            if (now := self.store.get(video_id)) is not None:
                yield _sse("video", now.to_json())
                if now.status in ("completed", "failed"):  # it has ended: this is the final Video already
                    return
            # The end may already be queued with the last step (one delivery ends the request), so the
            # queue is read to its end even once the request is no longer known.
            while self.served.knows(video_id) or not events.empty():
                event = await events.get()
                yield _sse(event.kind, event.to_json())
                if event.terminal:
                    break
            while (now := self.store.get(video_id)) is not None and now.status not in ("completed", "failed"):
                await asyncio.sleep(0.02)  # the mp4 is being written
            if now is not None:
                yield _sse("video", now.to_json())
        finally:  # the end, or a client that hung up
            self.served.unsubscribe(video_id, events)

    async def delete_video(self, video_id: str):
        item = self._find(video_id)
        self.store.remove(item.id)
        self.streams.drop(item.id)
        await self.served.cancel(item.id)
        return {"id": item.id, "object": "video.deleted", "deleted": True}

    # -- operations --------------------------------------------------------------------------------

    async def health(self):
        alive = self.served.error is None
        body = {"status": "ok" if alive else "engine_failed", "in_flight": self.served.in_flight}
        return JSONResponse(body, 200 if alive else 503)

    async def readiness(self):
        is_ready = self.ready and not self.draining and self.served.error is None
        return JSONResponse({"ready": is_ready, "draining": self.draining}, 200 if is_ready else 503)

    async def prometheus(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")


ROUTES = [
    ("POST", "/v1/videos", "create_video"), ("GET", "/v1/videos", "list_videos"),
    ("GET", "/v1/videos/{video_id}", "get_video"), ("GET", "/v1/videos/{video_id}/content", "video_content"),
    ("GET", "/v1/videos/{video_id}/events", "video_events"), ("DELETE", "/v1/videos/{video_id}", "delete_video"),
    ("POST", "/v1/videos/{video_id}/remix", "remix_video"),
    ("POST", "/v1/images/generations", "generate_images"), ("POST", "/v1/images/edits", "edit_images"), ("GET", "/v1/images/{image_id}/content", "image_content"),
    ("GET", "/health", "health"), ("GET", "/ready", "readiness"), ("GET", "/metrics", "prometheus"),
]  # fmt: skip


def create_app(served: AsyncEngine, store: VideoStore, settings: HttpSettings) -> FastAPI:
    """The app; `app.state.api` is its VideoApi (`app.state.api.drain()` starts a drain)."""
    api = VideoApi(served, store, settings)
    app = FastAPI(title="fvgraph", lifespan=api.lifespan, exception_handlers=error_handlers(api.metrics))
    app.state.api = api
    app.add_middleware(HttpGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       on_reject=api.metrics.reject, admin_api_key=settings.admin_api_key)  # fmt: skip
    # Outside the key check: a request for another Host, or a cross-site write to a keyless server, stops first.
    app.add_middleware(SameOriginGuard, allowed_hosts=settings.allowed_hosts, keyless=settings.api_key is None,
                       allowed_origins=settings.allowed_origins)  # fmt: skip
    add_cors(app, settings.allowed_origins)  # outside the guard: a preflight carries no key
    app.add_middleware(OpenAiErrorShape)  # outermost: it reshapes what the others answer in plain text
    adapters = AdapterApi(served, settings.lora_dir)
    models = ModelsApi(api.names)
    for owner, routes in ((api, ROUTES), (adapters, ADAPTER_ROUTES), (AdminApi(served), ADMIN_ROUTES), (models, MODEL_ROUTES)):
        for method, path, name in routes:  # a GET answers HEAD as well: the same headers, no body
            app.add_api_route(path, getattr(owner, name), methods=[method, "HEAD"] if method == "GET" else [method])
    if settings.playground:
        playground = PlaygroundApi(served, settings.max_prompt_chars)
        for method, path, name in PLAYGROUND_ROUTES:  # GET, so HEAD as well
            app.add_api_route(path, getattr(playground, name), methods=[method, "HEAD"] if method == "GET" else [method],
                              include_in_schema=False)  # fmt: skip
    return app


def _sse(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n"
