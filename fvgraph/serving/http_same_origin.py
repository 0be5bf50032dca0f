"""What a web page elsewhere cannot make a browser do to this server.

A browser sends some requests to any address without asking first (no CORS preflight): a POST whose
body is `text/plain` or an HTML form, and any request to a name that was re-pointed at 127.0.0.1
(DNS rebinding). Against a server with no API key, either would let any page drive the API. So:

- **Host**: a server that listens on a loopback address answers only requests naming a loopback
  host (`localhost`, `127.0.0.1`, `[::1]`, any port) or a name given with `--allowed-hosts`; others
  get 421. A server bound to another address checks the Host only when `--allowed-hosts` is given.
- **Origin**: without an API key, a request that changes state (POST, PUT, PATCH, DELETE) carrying an
  `Origin` that is neither this server's own (scheme-less match of the Host) nor one of
  `--allowed-origins` gets 403. A request with no Origin (curl, the SDKs) is not a browser's.
- **JSON routes** take `application/json` bodies only (415 otherwise), so a form or `text/plain`
  post cannot reach them, key or no key.
"""

from __future__ import annotations

import ipaddress
import re

from fvgraph.serving.http_guard import _respond

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
CHANGES_STATE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Routes whose handlers read a JSON body (the rest take multipart forms or no body).
JSON_ROUTES = (re.compile(r"/v1/loras"), re.compile(r"/v1/images/generations"), re.compile(r"/v1/videos/[^/]+/remix"),
               re.compile(r"/v1/admin/.+"))  # fmt: skip


def default_allowed_hosts(bind_host: str, given: tuple[str, ...]) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind_host` answers: the loopback names plus `given` for a
    loopback address, `given` alone elsewhere (None: any)."""
    if given:
        return tuple(dict.fromkeys(name.lower() for name in (*LOOPBACK_NAMES, *given)))
    try:
        loopback = bind_host == "localhost" or ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    return LOOPBACK_NAMES if loopback else None


def _host_name(host: str) -> str:
    """`host[:port]` -> host, keeping an IPv6 literal's brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class SameOriginGuard:
    def __init__(self, app, allowed_hosts: tuple[str, ...] | None, keyless: bool, allowed_origins: tuple[str, ...]):
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        self.keyless = keyless
        self.allowed_origins = frozenset(allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get(b"host", "")
        if self.allowed_hosts is not None and _host_name(host) not in self.allowed_hosts:
            message = (f"Host {host[:100]!r} is not a name this server answers to ({', '.join(sorted(self.allowed_hosts))}); "
                       "fvgraph serve --allowed-hosts NAME adds one")  # fmt: skip
            return await _respond(send, 421, message, "host_not_allowed")
        method = scope["method"]
        origin = headers.get(b"origin")
        if self.keyless and method in CHANGES_STATE and origin is not None and not self._same_site(origin, host):
            message = (f"a {method} from the web page at {origin[:100]!r} is refused: this server has no API key, so only "
                       "its own pages and --allowed-origins may change its state")  # fmt: skip
            return await _respond(send, 403, message, "cross_origin")
        if method in CHANGES_STATE and any(route.fullmatch(scope["path"]) for route in JSON_ROUTES) and _has_body(headers):
            kind = headers.get(b"content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                message = f"this route takes a JSON body: send Content-Type: application/json (got {kind[:80] or 'none'!r})"
                return await _respond(send, 415, message, "unsupported_media_type")
        return await self.app(scope, receive, send)

    def _same_site(self, origin: str, host: str) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        return origin.split("://", 1)[-1].lower() == host.strip().lower()


def _has_body(headers: dict) -> bool:
    length = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (length is not None and length.strip() not in ("", "0"))
