"""The bodies of the OpenAI-style endpoints, checked and mapped onto fvgraph Requests.

POST /v1/videos takes the OpenAI SDK's multipart form (prompt, model, seconds, size "WxH",
input_reference) or the same fields as JSON, plus fvgraph's own fields, which the SDK sends through
`extra_body`: num_frames, fps, num_inference_steps, guidance_scale, negative_prompt, seed, timeout,
cache (step caching: a JSON object, or in a form the text METHOD[:k=v,...] or a JSON object's text;
"none" turns the card's default off; docs/step_caching.md).
`seconds` x `fps` becomes a frame count rounded to the nearest the card allows (k * 4 + 1 for Wan);
`num_frames`, when given, must follow that rule itself. Every error is a RequestRejected naming the
field and the rule (HTTP 400).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any, Literal

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fvgraph.card import ModelCard
from fvgraph.request import Request, RequestRejected

SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")
DEFAULT_FPS = 16.0  # Wan 2.1 is trained at 16 frames per second
MAX_REFERENCE_PIXELS = 4096 * 4096


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, e.g. 832x480.")
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=30.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    timeout: float | None = Field(default=None, gt=0, description="Seconds after which the request is cancelled.")
    cache: str | dict[str, Any] | None = Field(default=None, description="Step caching, as Request(cache=...) takes it.")


class VideoBody(_Body):
    seconds: float | None = Field(default=None, gt=0, le=600)
    fps: float | None = Field(default=None, gt=0, le=120)
    num_frames: int | None = Field(default=None, ge=1)


class ImageBody(_Body):
    n: int = Field(default=1, ge=1, le=8)
    response_format: Literal["b64_json", "url"] = "b64_json"


@dataclass(frozen=True)
class Parsed:
    """A checked request and what the API reports back about it."""

    request: Request
    size: str
    seconds: str
    fps: float
    timeout: float | None


def parse_body(model: type[_Body], fields: dict) -> _Body:
    try:
        return model.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]
        name = ".".join(str(p) for p in first["loc"]) or "body"
        message = "unknown field; " + _known(model) if first["type"] == "extra_forbidden" else first["msg"]
        raise RequestRejected(name, message) from None


def _known(model: type[_Body]) -> str:
    return "this endpoint takes " + ", ".join(model.model_fields)


def _size(text: str | None, card: ModelCard) -> tuple[int, int]:
    if text is None:
        return card.shapes.default_width, card.shapes.default_height
    match = SIZE.fullmatch(text)
    if match is None:
        raise RequestRejected("size", f"{text!r} must be WIDTHxHEIGHT in pixels, e.g. "
                                      f"{card.shapes.default_width}x{card.shapes.default_height}")  # fmt: skip
    return int(match[1]), int(match[2])


def frames_for(seconds: float, fps: float, temporal_multiple: int) -> int:
    """The frame count nearest seconds * fps that the card allows: k * temporal_multiple + 1."""
    k = max(0, round((seconds * fps - 1) / temporal_multiple))
    return k * temporal_multiple + 1


def _request(body: _Body, card: ModelCard, request_id: str, max_prompt_chars: int, **shape) -> Request:
    if body.model is not None and body.model != card.card_id:
        raise RequestRejected("model", f"{body.model!r} is not served here; this server serves {card.card_id!r}")
    for name in ("prompt", "negative_prompt"):
        text = getattr(body, name)
        if text is not None and len(text) > max_prompt_chars:
            raise RequestRejected(name, f"{len(text)} characters exceed the limit of {max_prompt_chars} this server takes")
    try:
        return Request(prompt=body.prompt, negative_prompt=body.negative_prompt, num_inference_steps=body.num_inference_steps,
                       guidance_scale=body.guidance_scale, seed=body.seed, cache=body.cache, request_id=request_id,
                       **shape)  # fmt: skip
    except ValidationError as err:
        first = err.errors()[0]
        raise RequestRejected(".".join(str(p) for p in first["loc"]) or "body", first["msg"]) from None


def video_request(body: VideoBody, card: ModelCard, request_id: str, max_prompt_chars: int,
                  temporal_multiple: int, image: Image.Image | None = None) -> Parsed:  # fmt: skip
    width, height = _size(body.size, card)
    fps = body.fps or DEFAULT_FPS
    if body.num_frames is not None:
        frames = body.num_frames
    elif body.seconds is not None:
        frames = frames_for(body.seconds, fps, temporal_multiple)  # the weights' VAE: ModelFacts
    else:
        frames = card.shapes.default_frames
    seconds = f"{body.seconds:g}" if body.seconds is not None else f"{frames / fps:g}"
    shape = dict(height=height, width=width, num_frames=frames)
    request = _request(body, card, request_id, max_prompt_chars, **shape, **({} if image is None else {"image": image}))
    return Parsed(request, f"{width}x{height}", seconds, fps, body.timeout)


def image_request(body: ImageBody, card: ModelCard, request_id: str, max_prompt_chars: int, index: int) -> Parsed:
    width, height = _size(body.size, card)
    seed = None if body.seed is None else body.seed + index
    request = _request(body.model_copy(update={"seed": seed}), card, request_id, max_prompt_chars,
                       height=height, width=width, num_frames=1)  # fmt: skip
    return Parsed(request, f"{width}x{height}", "0", DEFAULT_FPS, body.timeout)


def check_input_reference(data: bytes, card: ModelCard, takes_image: bool) -> Image.Image:
    """An image-to-video reference: it must decode as an image of sane size, and the served loop must
    take one (`Loop.takes_image`). Returns it as RGB, for `Request(image=...)`."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_REFERENCE_PIXELS:
            raise RequestRejected("input_reference", f"{image.width}x{image.height} has more than {MAX_REFERENCE_PIXELS} pixels")
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
        raise RequestRejected("input_reference", f"is not a decodable image (PNG, JPEG, WebP): {err}") from None
    if not takes_image:
        raise RequestRejected("input_reference", f"card {card.card_id!r} generates from text only and takes no image; "
                                                 "serve an image-to-video card to use input_reference")  # fmt: skip
    return image.convert("RGB")
