"""What every HTTP request passes before it reaches an endpoint: the API key and the body size limit.

With a key set, every path but /health, /ready and / (the playground page, which holds nothing
and asks the API with the key a person types in) needs `Authorization: Bearer <key>` (compared in
constant time), else 401. A body larger than `max_body_bytes` gets 413: at once when its
Content-Length says so, and as soon as the bytes read pass the limit when it does not.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

OPEN_PATHS = frozenset({"/health", "/ready", "/"})


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes (--max-body-bytes)")


class HttpGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_reject: Callable[[str], None]):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes} must be positive")
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            scheme, _, key = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                self.on_reject("unauthorized")
                message = "missing or wrong API key: send 'Authorization: Bearer <key>' (--api-key or FVGRAPH_API_KEY)"
                return await _respond(send, 401, message, "invalid_api_key", {b"www-authenticate": b"Bearer"})
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            self.on_reject("too_large")
            return await _respond(send, 413, str(BodyTooLarge(self.max_body_bytes)), "body_too_large")
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return await self.app(scope, counted_receive, send)


async def _respond(send, status: int, message: str, code: str, extra: dict | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += list((extra or {}).items())
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
