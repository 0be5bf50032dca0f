"""The last net under OpenAI's error shape: an error answer (status 400 and up) that is not JSON,
such as the framework's plain-text 416 for a Range outside the file, is rewritten as
`{"error": {"message", "type", "param", "code"}}` with its status and headers kept.

Every refusal of fvgraph's own, and FastAPI's 404, 405 and validation errors, are shaped where they
are raised (fvgraph/serving/http_errors.py); this catches what the framework answers by itself.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from starlette.datastructures import Headers

from fvgraph.serving.http_errors import CODES, error_body

PLAIN_CODES = {**CODES, 400: "invalid_request", 416: "range_not_satisfiable"}


class OpenAiErrorShape:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict | None = None  # the start of a plain error answer, sent once its body is read
        chunks: list[bytes] = []

        async def shaped(message):
            nonlocal held
            if message["type"] == "http.response.start":
                kind = Headers(raw=message.get("headers", [])).get("content-type", "")
                if message["status"] >= 400 and not kind.startswith("application/json"):
                    held = message
                    return
                return await send(message)
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_shaped(send, scope, held, b"".join(chunks))

        await self.app(scope, receive, shaped)


async def _send_shaped(send, scope, start: dict, plain: bytes) -> None:
    status = start["status"]
    headers = Headers(raw=start.get("headers", []))
    text = plain.decode(errors="replace").strip() or HTTPStatus(status).phrase
    if status == 416 and (size := headers.get("content-range", "").rpartition("/")[2]):
        text += f": the file has {size} bytes; ask for a Range inside it"
    body = json.dumps(error_body(f"{scope['method']} {scope['path']}: {text}", status, None, PLAIN_CODES.get(status))).encode()
    kept = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-type", b"content-length")]
    kept += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({**start, "headers": kept})
    await send({"type": "http.response.body", "body": body})
