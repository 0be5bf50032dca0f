"""A stored file as a download: Starlette's FileResponse (HEAD, Range, If-Range) with an ETag, and
304 Not Modified for an If-None-Match that matches it.

A file's content never changes once it is written (one file per item and variant, written once,
renamed into place, deleted with its item), so the ETag is the item's id and variant: strong, the
same on every server that shares the store and after a restart. If-None-Match is compared weakly
(`W/` prefixes ignored) and `*` matches; it is checked before any Range, as HTTP orders them.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import Request as HttpRequest
from fastapi.responses import FileResponse, Response

# Caches may keep the file (each user's own: it is behind the API key) but ask again each time, with
# If-None-Match: the answer is 304 while it exists, 404 once it expired.
CACHE_CONTROL = "private, no-cache"


def etag(item_id: str, variant: str) -> str:
    return f'"{item_id}-{variant}"'


def file_download(http: HttpRequest, path: Path, media_type: str, tag: str) -> Response:
    headers = {"ETag": tag, "Cache-Control": CACHE_CONTROL}
    if _none_match(http.headers.get("if-none-match"), tag):
        return Response(status_code=304, headers=headers)
    return FileResponse(path, media_type=media_type, headers=headers)


def _none_match(header: str | None, tag: str) -> bool:
    """Whether If-None-Match names `tag` (or is `*`)."""
    if header is None:
        return False
    given = [part.strip() for part in header.split(",")]
    return "*" in given or any(part.removeprefix("W/") == tag for part in given)
