"""POST /v1/videos/{id}/remix (OpenAI's remix, body `{"prompt"}`): a new video with a new prompt on
a completed video's settings.

A video keeps what its remix reuses (StoredVideo.settings, in its record, so a restarted server can
remix it too): its request's height, width, num_frames, num_inference_steps, guidance_scale,
negative_prompt, cache and loras as they were asked for (the card's defaults fill the rest the same
way again), the seed it ran with (the engine's pick when none was given, recorded when it ends),
and the fps, size and seconds it reports. The card is the one that made it. The remix's own Video
names its source in `remixed_from_video_id` and keeps these settings in turn, so it can be remixed.

The source must exist (404) and be completed (409 while queued or running, or when it failed); a
video made from an input_reference cannot be remixed (409: the image or video is not kept), nor one made
before settings were recorded or by another card, nor one whose adapter name now holds another file
than the digest it recorded (409 naming `loras`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fvgraph.request import Request, RequestRejected
from fvgraph.serving.http_errors import ApiError
from fvgraph.serving.openai_requests import Parsed
from fvgraph.serving.video_store import StoredVideo

REUSED = ("negative_prompt", "num_inference_steps", "guidance_scale", "height", "width", "num_frames", "seed", "cache",
          "loras")  # fmt: skip


class RemixBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    extensions: ClassVar[tuple[str, ...]] = ()  # `extra_params` holds nothing a remix takes (parse_body)

    prompt: str = Field(min_length=1, description="The new prompt; everything else is the source video's.")


def remix_settings(parsed: Parsed) -> dict:
    """What a remix of the video `parsed` describes will reuse (JSON, for its record)."""
    request = parsed.request
    return {"request": request.model_dump(mode="json", include=set(REUSED)), "fps": parsed.fps, "size": parsed.size,
            "seconds": parsed.seconds, "input_reference": request.image is not None or request.video is not None}  # fmt: skip


def with_seed(settings: dict, seed: int, lora_digests: dict[str, str]) -> dict:
    """The settings with the seed the video ran with and the digest of each adapter it used."""
    return {**settings, "request": {**settings["request"], "seed": seed}, "lora_digests": dict(lora_digests)}


def remix_request(source: StoredVideo, body: RemixBody, serves: Callable[[str], bool], request_id: str,
                  max_prompt_chars: int, loaded_digests: dict[str, str]) -> Parsed:  # fmt: skip
    """The request of a remix of `source` with `body.prompt`, or an ApiError saying why it cannot be
    made. `loaded_digests`: each adapter loaded now, by name; an adapter the source used must still
    be the same file under its name, or the remix would render with another one."""
    refusal = _refusal(source, serves)
    if refusal is not None:
        raise ApiError(409, f"video {source.id!r} cannot be remixed: {refusal}", "video_id", "remix_unavailable")
    for name, digest in (source.settings.get("lora_digests") or {}).items():
        if loaded_digests.get(name) != digest:
            now = "is not loaded" if name not in loaded_digests else f"now holds another file (digest {loaded_digests[name]})"
            raise ApiError(409, f"video {source.id!r} cannot be remixed: its lora {name!r} (digest {digest}) {now}; "
                                "load the adapter it was made with", "loras", "remix_unavailable")  # fmt: skip
    if len(body.prompt) > max_prompt_chars:
        raise RequestRejected("prompt", f"{len(body.prompt)} characters exceed the limit of {max_prompt_chars} this server takes")
    settings = source.settings
    try:
        request = Request(prompt=body.prompt, request_id=request_id, **settings["request"])
    except (ValidationError, TypeError) as err:  # a record from another version of this server
        raise ApiError(409, f"video {source.id!r} cannot be remixed: its recorded settings are not a request "
                            f"this server takes ({err})", "video_id", "remix_unavailable") from None  # fmt: skip
    return Parsed(request, settings["size"], settings["seconds"], settings["fps"], None)


def _refusal(source: StoredVideo, serves: Callable[[str], bool]) -> str | None:
    if source.status != "completed":
        return f"it is {source.status}; only a completed video can be remixed" + (
            " (wait until it completes)" if source.status in ("queued", "in_progress") else "")
    if source.settings is None:
        return "it was made before this server recorded the settings a remix reuses; create a new video instead"
    if source.settings.get("input_reference"):
        return "it was made from an input_reference, which is not kept; create a new video with the image or video instead"
    if not serves(source.model):
        return f"it was made as model {source.model!r}, which this server does not serve"
    return None
