"""The images endpoints of the HTTP API (fvgraph/serving/http_app.py's VideoApi serves them):
POST /v1/images/generations runs `n` one-frame requests through the same engine and answers when all
have ended (b64_json, or a URL to GET /v1/images/{id}/content); a client that hangs up cancels them.
POST /v1/images/edits does the same from an uploaded `image` (the openai SDK's `images.edit`), on a
card that edits images (FLUX.1 Kontext, Qwen-Image-Edit); with no size sent, the size the card's loop
picks for that image, as the Python API's."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Coroutine

from fastapi import Request as HttpRequest
from PIL import Image
from starlette.requests import ClientDisconnect

from fvgraph.request import RequestRejected
from fvgraph.serving.http_content import etag, file_download
from fvgraph.serving.http_errors import ApiError
from fvgraph.serving.media_encode import IMAGE_MEDIA_TYPES, encode_image
from fvgraph.serving.openai_requests import ImageBody, check_input_reference, image_request, parse_body
from fvgraph.serving.video_store import IMAGE_VARIANTS, StoredVideo

log = logging.getLogger(__name__)


class ImageRoutes:
    """Reads the API's card, names, served engine, store, settings, `_fields`, `_sized` and `_accept`."""

    async def generate_images(self, http: HttpRequest):
        return await self._images(http, await self._fields(http), None)

    async def edit_images(self, http: HttpRequest):
        fields = await self._fields(http)
        upload = fields.pop("image", None)
        if fields.pop("mask", None) is not None:
            raise RequestRejected("mask", "this server edits the whole image: leave mask out")
        if upload is None:
            raise RequestRejected("image", "upload the image to edit as a file in a multipart form")
        if isinstance(upload, list):
            raise RequestRejected("image", f"{len(upload)} images: card {self.card.card_id!r} edits one image at a time")
        if not isinstance(upload, bytes):  # a URL or file id: fetching what a client names is not done here
            raise RequestRejected("image", "must be the image itself, uploaded as a file; this server fetches no URLs or file ids")
        edits = "image" in self.served.engine.loop.reads and self.card.shapes.max_frames == 1
        image = check_input_reference(upload, self.card, edits, field="image", serve="an image-editing card (FLUX.1 Kontext, Qwen-Image-Edit)")
        return await self._images(http, fields, image)

    async def _images(self, http: HttpRequest, fields: dict, image: Image.Image | None):
        body = parse_body(ImageBody, fields)
        self.names.check(body.model)
        if body.n > self.served.admission.max_queue:  # its requests are queued together: it would always get 429
            raise RequestRejected("n", f"{body.n} images are more than this server queues at once "
                                       f"({self.served.admission.max_queue}, --max-queue); ask for fewer")  # fmt: skip
        if body.not_applied:
            log.info("images: %s accepted and not applied (the served card renders as it does)", body.not_applied)
        base = self.store.new_id("image")
        parsed = [self._sized(image_request(body, self.card, f"{base}-{i}" if body.n > 1 else base, self.settings.max_prompt_chars,
                                            i, image)) for i in range(body.n)]  # fmt: skip
        subscriptions = [(one.request.request_id, self.served.subscribe(one.request.request_id)) for one in parsed]
        try:
            for one in parsed:
                self._accept(one)
            results = await _unless_hung_up(http, _results_of([events for _, events in subscriptions]))
        finally:  # a refused request, or a client that hung up, takes the others of its call with it
            for request_id, events in subscriptions:
                self.served.unsubscribe(request_id, events)
            await asyncio.gather(*(self.served.cancel(request_id) for request_id, _ in subscriptions))  # one step boundary
        data = []
        for one, result in zip(parsed, results):
            if not result.ok:
                raise ApiError(503 if result.status == "cancelled" else 500,
                               f"image {one.request.request_id} {result.status}: {result.error or 'cancelled'}")  # fmt: skip
            encoded = await asyncio.to_thread(encode_image, result.frames[0], body.encoding, body.output_compression)
            if body.response_format != "url":
                data.append({"b64_json": base64.b64encode(encoded).decode(), "revised_prompt": None})
                continue
            item = self.store.add(StoredVideo(one.request.request_id, "image", body.model or self.card.card_id, body.prompt,
                                              one.size, "0", 1, one.fps, int(time.time())))  # fmt: skip
            self.store.finish(item.id, "completed", content={IMAGE_VARIANTS[body.encoding]: encoded})
            data.append({"url": str(http.base_url) + f"v1/images/{item.id}/content", "revised_prompt": None})
        # `background` is what was rendered: every frame is opaque, whatever the request asked
        return {"id": base, "created": int(time.time()), "data": data, "output_format": body.encoding, "size": parsed[0].size,
                "quality": body.quality, "background": "opaque"}  # fmt: skip

    async def image_content(self, image_id: str, http: HttpRequest):
        item = self.store.get(image_id)
        variant = None if item is None or item.object != "image" else next(iter(item.files), None)
        path = None if variant is None else self.store.content(item.id, variant)
        if path is None:
            raise ApiError(404, f"no image {image_id!r} (it never existed or expired)", "image_id", "not_found")
        image_format = next(name for name, stored in IMAGE_VARIANTS.items() if stored == variant)
        return file_download(http, path, IMAGE_MEDIA_TYPES[image_format], etag(item.id, variant))


async def _unless_hung_up(http: HttpRequest, waiting: Coroutine):
    """What `waiting` returns; ClientDisconnect, with `waiting` cancelled, once the client hangs up."""
    answer, hung_up = asyncio.ensure_future(waiting), asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({answer, hung_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (answer, hung_up):
            task.cancel()
    if not answer.cancelled() and answer.done():
        return answer.result()
    raise ClientDisconnect()


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client hangs up (its body has been read: the next ASGI message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _results_of(subscriptions: list[asyncio.Queue]) -> list:
    results = []
    for events in subscriptions:
        while not (event := await events.get()).terminal:
            pass
        results.append(event.result)
    return results
