"""`GET /v1/videos/{id}/content?stream=true`: the video as fragmented MP4 while it decodes.

The answer is the video's LiveVideo (fvgraph/serving/video_streams.py) from its start, sent with
chunked transfer as each fragment is made, ending with the video; a `<video>` element or PyAV plays
it as it arrives. A video that has completed is answered with its stored file, as without `stream`.
"""

from __future__ import annotations

from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from fvgraph.request import RequestRejected
from fvgraph.serving.video_streams import LiveVideo

_FLAGS = {"true": True, "1": True, "false": False, "0": False}
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def stream_flag(value: str | None, variant: str) -> bool:
    """The `stream` query field: true / false (1 / 0); RequestRejected naming it for anything else."""
    if value is None:
        return False
    flag = _FLAGS.get(value.strip().lower())
    if flag is None:
        raise RequestRejected("stream", f"{value!r} must be true or false")
    if flag and variant != "video":
        raise RequestRejected("stream", f"only the video streams; variant={variant!r} is a finished image: leave stream unset")
    return flag


def streamed_mp4(http: HttpRequest, live: LiveVideo) -> Response:
    if http.method == "HEAD":  # the stream's headers; its body would run until the video ends
        return Response(media_type="video/mp4", headers=HEADERS)
    return StreamingResponse(live.read(), media_type="video/mp4", headers=HEADERS)
