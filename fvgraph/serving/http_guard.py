"""What every HTTP request passes before it reaches an endpoint: the API keys and the body size limit.

With a key set, every path but /health, /ready and / (the playground page, which holds nothing
and asks the API with the key a person types in) needs `Authorization: Bearer <key>` (compared in
constant time), else 401. With an admin key set (`--admin-api-key`), the admin actions (loading and
unloading adapters, sleep and wake) take that key alone, so a key that generates cannot open files or
put the engine to sleep; without one they take the API key, as every other route. A body larger than `max_body_bytes` gets 413: at once when its
Content-Length says so, and as soon as the bytes read pass the limit when it does not.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

OPEN_PATHS = frozenset({"/health", "/ready", "/"})
# (method, path prefix) of the admin actions: they change what the engine serves, not one request.
ADMIN_ROUTES = (("POST", "/v1/loras"), ("DELETE", "/v1/loras/"), ("POST", "/v1/admin/"))


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes (--max-body-bytes)")


class HttpGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_reject: Callable[[str], None],
                 admin_api_key: str | None = None):  # fmt: skip
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes} must be positive")
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        admin = self.admin_api_key is not None and any(
            scope["method"] == method and (scope["path"] == prefix or prefix.endswith("/") and scope["path"].startswith(prefix))
            for method, prefix in ADMIN_ROUTES)  # fmt: skip
        needed = self.admin_api_key if admin else self.api_key
        if needed is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            scheme, _, key = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), needed):
                self.on_reject("unauthorized")
                which = "the admin key (--admin-api-key or FVGRAPH_ADMIN_API_KEY)" if admin else "the API key (--api-key or FVGRAPH_API_KEY)"
                message = f"missing or wrong key: this route takes {which}, sent as 'Authorization: Bearer <key>'"
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
