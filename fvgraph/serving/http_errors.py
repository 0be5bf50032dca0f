"""Every HTTP error as OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, with its status.

`param` names the field the client sent (a body field, a query parameter, `body` for the body as a
whole, `input_reference` for the upload) or is null where no field is at fault (an unknown path).
This covers fvgraph's own refusals (RequestRejected, ApiError, QueueFull, EngineClosed,
BodyTooLarge) and what the framework raises before an endpoint runs: a query parameter of the wrong
type (FastAPI's RequestValidationError), a path or method that does not exist (Starlette's
HTTPException; a 405's Allow names every method routed for the path). A client that hangs up
mid-body (ClientDisconnect) is logged on one line, not as a traceback: there is nobody left to answer.
"""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.routing import Match

from fvgraph.request import RequestRejected
from fvgraph.serving.admission import QueueFull
from fvgraph.serving.async_engine import EngineClosed
from fvgraph.serving.http_guard import BodyTooLarge
from fvgraph.serving.serving_metrics import ServingMetrics

log = logging.getLogger(__name__)
# Request fields whose name is not the API's: on /v1/videos the loop checks `image` (or a
# video-to-video request's `video`), the client sends `input_reference` (/v1/images/edits sends `image`).
API_NAMES = {"image": "input_reference", "video": "input_reference"}
RENAMED_UNDER = "/v1/videos"
CODES = {404: "not_found", 405: "method_not_allowed"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def api_param(field: str, path: str = RENAMED_UNDER) -> str:
    """The field a client sent to `path` for a RequestRejected's field (`cache.mag_ratios` was sent as `cache`)."""
    top = field.split(".")[0]
    return API_NAMES.get(top, top) if path.startswith(RENAMED_UNDER) else top


def routed_methods(http: HttpRequest) -> str:
    """A 405's Allow header: every method routed for the request's path. Starlette's own names the
    methods of the first route whose path matches, and a path several routes serve (GET and POST
    /v1/videos, GET and DELETE /v1/videos/{id}) has more."""
    methods = set()
    for route in http.app.router.routes:
        if route.matches(http.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def error_handlers(metrics: ServingMetrics) -> dict:
    """Each refusal as an OpenAI error body with its status, counted by reason."""

    def refusal(status: int, reason: str, code: str, param: str | None = None, retry_after=None):
        async def handle(_, err: Exception):
            metrics.reject(reason)
            headers = None if retry_after is None else {"Retry-After": str(retry_after(err))}
            return JSONResponse(error_body(str(err), status, param, code), status, headers=headers)

        return handle

    async def rejected(http: HttpRequest, err: RequestRejected):
        metrics.reject("memory" if err.field == "memory_budget" else "invalid")
        param = api_param(err.field, http.url.path)
        rule = str(err)[len(err.field) + 2 :]  # RequestRejected's text is "FIELD: RULE"
        message = str(err) if param == err.field.split(".")[0] else f"{param} (the request's {err.field}): {rule}"
        return JSONResponse(error_body(message, 400, param, "invalid_value"), 400)

    async def api_error(_, err: ApiError):
        return JSONResponse(error_body(str(err), err.status, err.param, err.code), err.status, headers=err.headers)

    async def invalid_parameter(_, err: RequestValidationError):
        metrics.reject("invalid")
        first = err.errors()[0]
        name = str(first["loc"][-1]) if first.get("loc") else "body"
        return JSONResponse(error_body(f"{name}: {first['msg']}", 400, name, "invalid_value"), 400)

    async def http_error(http, err: HTTPException):
        message = f"{http.method} {http.url.path}: {err.detail}"
        headers = getattr(err, "headers", None)
        if err.status_code == 405:
            headers = {**(headers or {}), "Allow": routed_methods(http)}
        return JSONResponse(error_body(message, err.status_code, None, CODES.get(err.status_code)), err.status_code,
                            headers=headers)  # fmt: skip

    async def hung_up(http, _: ClientDisconnect):
        log.info("%s %s: the client hung up before its request body arrived", http.method, http.url.path)
        return Response(status_code=400)  # never sent: the connection is gone

    async def internal(_, err: Exception):  # a bug: the traceback is logged by the server as well
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", 500, None, "internal_error"), 500)

    return {
        ApiError: api_error,
        RequestRejected: rejected,
        QueueFull: refusal(429, "queue_full", "queue_full", retry_after=lambda err: err.retry_after),
        EngineClosed: refusal(503, "draining", "unavailable", retry_after=lambda err: 5),
        BodyTooLarge: refusal(413, "too_large", "body_too_large", param="body"),
        RequestValidationError: invalid_parameter,
        HTTPException: http_error,
        ClientDisconnect: hung_up,
        Exception: internal,
    }
