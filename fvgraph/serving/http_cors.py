"""Requests from web pages on other origins (`fvgraph serve --allowed-origins ORIGIN`, repeatable).

Starlette's CORSMiddleware sits outside the API key check (HttpGuard): a browser sends its preflight
(OPTIONS with Origin and Access-Control-Request-Method) without the Authorization header, so the
preflight is answered before any key is asked for; the request that follows carries the key as
usual. Answers to a listed origin (or any, with `*`) carry Access-Control-Allow-Origin, and expose
the headers a page needs to read (EXPOSED_HEADERS). No cookies are involved (the key is a Bearer
header), so credentials are not allowed. A preflight that asks for an origin or a method not
allowed gets 400 in OpenAI's error shape. Without the option nothing is added: no CORS headers,
and an OPTIONS request is an ordinary one (401 without the key, 405 with it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from fvgraph.serving.http_errors import error_body

ALLOWED_METHODS = ("GET", "HEAD", "POST", "DELETE")
EXPOSED_HEADERS = ("Retry-After", "ETag", "Content-Range", "Accept-Ranges")  # beyond the safelisted ones
_ORIGIN = re.compile(r"https?://[^/?#\s]+")  # scheme://host[:port], as a browser sends it in Origin
_FAILURES = {"origin": "Origin", "method": "Access-Control-Request-Method", "headers": "Access-Control-Request-Headers",
             "private-network": "Access-Control-Request-Private-Network"}  # fmt: skip


def check_origins(origins: Iterable[str]) -> tuple[str, ...]:
    """The origins as a tuple; ValueError naming the option for one that is not `*` or an origin."""
    origins = tuple(origins)
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ValueError(f"--allowed-origins {origin!r} must be '*' or an origin, scheme://host[:port] with no "
                             "path and no trailing slash, e.g. http://localhost:3000")  # fmt: skip
    return origins


class ApiCors(CORSMiddleware):
    """CORSMiddleware whose refused preflight says why in OpenAI's error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code < 400:
            return answer
        failures = answer.body.decode().removeprefix("Disallowed CORS ").split(", ")
        named = [_FAILURES.get(failure, failure) for failure in failures]
        asked = "; ".join(f"{name} {request_headers.get(name)!r}" for name in named)
        message = (f"CORS preflight refused: {asked} not allowed; this server allows the origins "
                   f"{', '.join(self.allow_origins)} (--allowed-origins) and the methods {', '.join(self.allow_methods)}")  # fmt: skip
        headers = {k: v for k, v in answer.headers.items() if k not in ("content-type", "content-length")}
        return JSONResponse(error_body(message, 400, named[0], "cors_not_allowed"), 400, headers=headers)


def add_cors(app, origins: tuple[str, ...]) -> None:
    """CORS for `origins` (nothing when there are none); call after the guard is added, so it runs first."""
    if origins:
        app.add_middleware(ApiCors, allow_origins=list(origins), allow_methods=ALLOWED_METHODS, allow_headers=["*"],
                           expose_headers=EXPOSED_HEADERS)  # fmt: skip
