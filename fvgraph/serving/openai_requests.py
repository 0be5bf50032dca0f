"""The bodies of the OpenAI-style endpoints, checked and mapped onto fvgraph Requests.

POST /v1/videos takes the OpenAI SDK's multipart form (prompt, model, seconds, size "WxH",
input_reference) or the same fields as JSON, plus fvgraph's own fields, which the SDK sends through
`extra_body`: num_frames, fps, num_inference_steps, guidance_scale, negative_prompt, seed, timeout, preview_every,
cache (step caching: a JSON object, or in a form the text METHOD[:k=v,...] or a JSON object's text;
"none" turns the card's default off; docs/step_caching.md); and the peers' fields
(fvgraph/serving/client_fields.py). POST /v1/images/generations takes OpenAI's image fields as well.
`seconds` x `fps`, or `num_frames`, becomes the frame count nearest it that the card allows
(k * 4 + 1 for Wan, ties going up); the Video's `num_frames` is that count and its `seconds` what was
rendered: frames / the frame rate the mp4 is written at. A number field refuses a boolean (JSON `true` is not
1) and a non-finite value. Every error is a RequestRejected naming the field the client sent and
the rule (HTTP 400).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator

from fvgraph.card import ModelCard
from fvgraph.media_file import INPUT_IMAGE_FORMATS
from fvgraph.request import Request, RequestRejected, refuse_boolean
from fvgraph.serving.client_fields import (IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, SentAs, fold_extra_params, named_as_sent,
                                           nearest_frame_count, pixel_size, refuse_deploy_time)  # fmt: skip
from fvgraph.serving.media_encode import MAX_FPS, MIN_FPS, mp4_rate

DEFAULT_FPS = 16.0  # Wan 2.1 is trained at 16 frames per second
SEED_RANGE = 2**63  # seeds are 0 <= seed < 2**63; image i of n gets (seed + i) modulo this
# input_reference: the formats the API documents (INPUT_IMAGE_FORMATS), and at most this many pixels,
# checked from the header before any pixel is decoded.
MAX_REFERENCE_PIXELS = 4096 * 4096
MAX_JSON_DEPTH = 32  # how deeply a JSON field may nest; a real one nests 2 (cache settings holding mag_ratios)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    extensions: ClassVar[tuple[str, ...]] = IMAGE_EXTENSIONS  # what `extra_params` may hold

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, e.g. 832x480; 'auto' is the card's default "
                                                           "(a request from an image: the loop's size for the image).")
    width: int | None = Field(default=None, gt=0, le=99999, description="The peers' name for size's width.")
    height: int | None = Field(default=None, gt=0, le=99999, description="The peers' name for size's height.")
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=30.0)
    guidance_scale_2: float | None = Field(default=None, ge=0.0, le=30.0, description="Two-expert cards: the low-noise expert's.")
    true_cfg_scale: float | None = Field(default=None, ge=0.0, le=30.0,
                                         description="FLUX / Qwen-Image cards: > 1 with negative_prompt runs classifier-free guidance.")
    seed: int | None = Field(default=None, ge=0, lt=SEED_RANGE)
    timeout: float | None = Field(default=None, gt=0, description="Seconds after which the request is cancelled.")
    cache: Any = Field(default=None, description="Step caching, as Request(cache=...) takes it (and checks it).")
    loras: Any = Field(default=None, description='LoRA adapters by name and scale, {"style": 0.7} (a form sends its JSON text).')
    flow_shift: Any = Field(default=None, description="Refused: the sampler's shift is chosen at deploy time.")
    boundary_ratio: Any = Field(default=None, description="Refused: the experts' boundary is chosen at deploy time.")
    user: str | None = Field(default=None, max_length=256, description="The end user, for logs; accepted and reported.")

    _sent: SentAs = PrivateAttr(default_factory=dict)  # body field -> the field the client sent it as
    _not_a_boolean = field_validator("num_inference_steps", "guidance_scale", "guidance_scale_2", "true_cfg_scale", "seed", "timeout",
                                     "width", "height", mode="before")(refuse_boolean)  # fmt: skip


class VideoBody(_Body):
    extensions: ClassVar[tuple[str, ...]] = VIDEO_EXTENSIONS

    seconds: float | None = Field(default=None, gt=0, le=600)
    fps: float | None = Field(default=None, ge=MIN_FPS, le=MAX_FPS, description="Frames per second of the mp4.")
    num_frames: int | None = Field(default=None, ge=1, le=100_000, description="Rounded to the nearest the card allows.")
    n: int | None = Field(default=None, description="vLLM-Omni's video count: 1 (one video per call).")
    strength: float | None = Field(default=None, gt=0.0, le=1.0, description="With a video input_reference: how far "
                                   "from it to go, in (0, 1] (default 0.8), as Request.strength.")  # fmt: skip
    preview_every: int | None = Field(default=None, ge=1, le=1000, description="A `preview` event (PNG) on the video's "
                                      "event stream after every k-th denoise step and the last (docs/previews.md).")

    _numbers_not_booleans = field_validator("seconds", "fps", "num_frames", "n", "strength", "preview_every",
                                            mode="before")(refuse_boolean)  # fmt: skip

    @field_validator("n")
    @classmethod
    def _one_video(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"n={value}: this server makes one video per call; send {value} calls")
        return value


class ImageBody(_Body):
    n: int = Field(default=1, ge=1, le=10)
    response_format: Literal["b64_json", "url"] | None = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] | None = Field(default=None, description="How each image is encoded; null: png.")
    output_compression: int | None = Field(default=None, ge=0, le=100, description="jpeg and webp: the encoder's quality, 0-100.")
    # OpenAI's hosted models read these; fvgraph accepts them, logs them and renders as the card does.
    quality: Literal["auto", "low", "medium", "high", "standard", "hd"] | None = None
    style: Literal["vivid", "natural"] | None = None
    background: Literal["auto", "opaque", "transparent"] | None = None
    moderation: Literal["auto", "low"] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    stream: bool | None = Field(default=None, description="false only: images are answered whole.")
    partial_images: int | None = Field(default=None, description="0 only: no partial images are streamed.")
    auto_resize: bool | None = Field(default=None, description="Edits on FLUX.1 Kontext cards: false encodes the image at "
                                     "its own size instead of the Kontext resolution nearest its aspect ratio, as Request.auto_resize.")

    _count_not_a_boolean = field_validator("n", "output_compression", "partial_images", mode="before")(refuse_boolean)

    @field_validator("stream", "partial_images")
    @classmethod
    def _not_streamed(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name}={value!r}: this server answers images whole and streams no partial "
                             "images; leave it out (or send false / 0)")  # fmt: skip
        return value

    @field_validator("output_compression")
    @classmethod
    def _compression_is_lossy(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("output_format") in (None, "png"):  # declared before it: checked already
            raise ValueError(f"output_compression={value} applies to jpeg and webp; this request's output_format is "
                             "png (lossless): leave it out or ask for jpeg or webp")  # fmt: skip
        return value

    @property
    def encoding(self) -> str:
        return self.output_format or "png"

    @property
    def not_applied(self) -> dict[str, str]:
        """OpenAI's rendering fields this request sent, which the served card does not read."""
        names = ("quality", "style", "background", "moderation", "user", "safety_identifier")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass(frozen=True)
class Parsed:
    """A checked request and what the API reports back about it."""

    request: Request
    size: str | None  # None: the served loop's pick, known once it checked the request
    seconds: str
    fps: float
    timeout: float | None
    sent_as: SentAs = field(default_factory=dict)  # a Request field -> the field the client sent (`width` -> `size`)
    notes: dict[str, str] = field(default_factory=dict)  # how a Request field was derived, for its errors


def json_fields(raw: bytes) -> dict:
    """A JSON body as its fields: an object whose values nest at most MAX_JSON_DEPTH deep (deeper
    input would reach Python's recursion limit in the parser or in what reads it later). Too deep a
    value is refused naming its field."""
    try:
        fields = json.loads(raw)
    except RecursionError:
        name = _deep_field(raw.decode("utf-8", errors="replace"))
        raise RequestRejected(name, f"is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as err:  # UnicodeDecodeError too
        raise RequestRejected("body", f"is not valid JSON: {err}") from None
    if not isinstance(fields, dict):
        raise RequestRejected("body", f"must be a JSON object, got {type(fields).__name__}")
    for name, value in fields.items():
        if _depth(value) > MAX_JSON_DEPTH:
            raise RequestRejected(name, f"is nested deeper than {MAX_JSON_DEPTH} levels")
    return fields


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in `value` (a scalar: 0, [1]: 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # strings (skipped whole) and brackets


def _deep_field(text: str) -> str:
    """The top-level field of a body too deep to parse: the last string at the top level before the
    nesting passes MAX_JSON_DEPTH is its key ("body" when there is none)."""
    depth, key = 0, None
    for token in _JSON_TOKENS.finditer(text):
        mark = token.group()
        if mark in ("[", "{"):
            depth += 1
            if depth > MAX_JSON_DEPTH + 1:
                break
        elif mark in ("]", "}"):
            depth -= 1
        elif depth == 1:
            key = mark
    try:
        name = json.loads(key) if key is not None else "body"
    except ValueError:
        return "body"
    return name[:64] if isinstance(name, str) else "body"


def parse_body(model: type[_Body], fields: dict) -> _Body:
    """The body of `fields`, with `extra_params`' keys read as top-level fields (client_fields.py); an
    error names the field as the client sent it."""
    fields, sent = fold_extra_params(fields, model.extensions)
    with named_as_sent(sent):
        try:
            body = model.model_validate(fields)
        except ValidationError as err:
            raise _rejected(err, "unknown field; " + _known(model)) from None
    body._sent = sent
    return body


def _rejected(err: ValidationError, unknown: str = "unknown field") -> RequestRejected:
    """The first error, named by the field the client sent (pydantic's location can go on into a
    union member's type name, which no client sent)."""
    first = err.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else "body"
    return RequestRejected(name, unknown if first["type"] == "extra_forbidden" else first["msg"])


def _known(model: type[_Body]) -> str:
    return "this endpoint takes " + ", ".join([*model.model_fields, "extra_params"])


def _request(body: _Body, card: ModelCard, request_id: str, max_prompt_chars: int, sent: SentAs, notes: dict[str, str],
             **shape) -> Request:  # fmt: skip
    with named_as_sent(sent, notes):
        for name in ("prompt", "negative_prompt"):
            text = getattr(body, name)
            if text is not None and len(text) > max_prompt_chars:
                raise RequestRejected(name, f"{len(text)} characters exceed the limit of {max_prompt_chars} this server takes")
        refuse_deploy_time({"flow_shift": body.flow_shift, "boundary_ratio": body.boundary_ratio}, card)
        try:
            return Request(prompt=body.prompt, negative_prompt=body.negative_prompt, num_inference_steps=body.num_inference_steps,
                           guidance_scale=body.guidance_scale, guidance_scale_2=body.guidance_scale_2,
                           true_cfg_scale=body.true_cfg_scale, seed=body.seed,
                           cache=body.cache, request_id=request_id, loras=_loras(body.loras), **shape)  # fmt: skip
        except ValidationError as err:
            raise _rejected(err) from None


_BRACKETED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[[^\[\]]+\])+)")


def nested_form_fields(fields: dict) -> dict:
    """Form keys such as `loras[style]` (how the OpenAI SDK sends a dict in `extra_body`) folded into
    the nested field: {"loras": {"style": "0.7"}}. A key given both ways is refused naming it."""
    out: dict = {}
    for key, value in fields.items():
        match = _BRACKETED.fullmatch(key)
        if match is None:
            if key in out:
                raise RequestRejected(key, "is given twice (as a field and as bracketed keys)")
            out[key] = value
            continue
        name, path = match.group(1), re.findall(r"\[([^\[\]]+)\]", match.group(2))
        node = out.setdefault(name, {})
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict) or path[-1] in node:
            raise RequestRejected(name, f"form key {key!r} conflicts with another value of {name}")
        node[path[-1]] = value
    return out


def _loras(value: Any) -> Any:
    """A form field carries the JSON object as text, or bracketed keys with text scales; Request
    checks the names and scales."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestRejected("loras", 'must be a JSON object of adapter names and scales, e.g. {"style": 0.7}') from None
    if isinstance(value, dict):
        scales = {}
        for name, scale in value.items():
            try:
                scales[name] = float(scale) if isinstance(scale, str) else scale
            except ValueError:
                raise RequestRejected("loras", f"loras[{name!r}]={scale!r} must be a number") from None
        return scales
    return value


def frames_for(seconds: float, fps: float, temporal_multiple: int) -> int:
    """The frame count nearest seconds * fps that the card allows: k * temporal_multiple + 1."""
    return nearest_frame_count(seconds * fps, temporal_multiple)


def video_request(body: VideoBody, card: ModelCard, request_id: str, max_prompt_chars: int, temporal_multiple: int,
                  image: Image.Image | None = None, video: list[Image.Image] | None = None) -> Parsed:  # fmt: skip
    """A /v1/videos request; `image` an image-to-video reference, `video` a video-to-video one, whose
    frames are the request's unless the client also sent a frame count (which must then agree). With
    an image, what the client left out of the size is the served loop's to pick (size None)."""
    width, height, sent = _shape_sent_as(body, card, image)
    notes: dict[str, str] = {}
    fps = body.fps or DEFAULT_FPS
    if video is not None and body.num_frames is None and body.seconds is None:
        frames = len(video)
    elif body.num_frames is not None:
        frames = nearest_frame_count(body.num_frames, temporal_multiple)  # vLLM-Omni sends 32 or 80
        sent["num_frames"] = body._sent.get("num_frames", "num_frames")
        if frames != body.num_frames:
            notes["num_frames"] = f"num_frames={body.num_frames} was rounded to {frames}, the nearest count of " \
                                  f"k * {temporal_multiple} + 1 frames"  # fmt: skip
    elif body.seconds is not None:
        frames = frames_for(body.seconds, fps, temporal_multiple)  # the weights' VAE: ModelFacts
        sent["num_frames"] = "seconds"
    else:
        frames = card.shapes.default_frames
    seconds = f"{frames / float(mp4_rate(fps)):g}"  # what is rendered and written, not what was asked
    shape = dict(height=height, width=width, num_frames=frames, preview_every=body.preview_every,
                 **({} if image is None else {"image": image}))
    if video is not None:
        shape.update(video=video, strength=body.strength)
    elif body.strength is not None:
        raise RequestRejected("strength", "sets how far a video-to-video request goes from its video: upload the video "
                                          "as input_reference with it")  # fmt: skip
    request = _request(body, card, request_id, max_prompt_chars, sent, notes, **shape)
    return Parsed(request, _size(width, height), seconds, fps, body.timeout, sent, notes)


def image_request(body: ImageBody, card: ModelCard, request_id: str, max_prompt_chars: int, index: int,
                  image: Image.Image | None = None) -> Parsed:  # fmt: skip
    """Image `index` of a /v1/images call; `image` the image an edit starts from (what the client
    left out of its size is the served loop's to pick: size None)."""
    width, height, sent = _shape_sent_as(body, card, image)
    seed = None if body.seed is None else (body.seed + index) % SEED_RANGE  # every valid seed works for any n
    request = _request(body.model_copy(update={"seed": seed}), card, request_id, max_prompt_chars, sent, {},
                       height=height, width=width, num_frames=1, **({} if image is None else {"image": image}),
                       **({} if body.auto_resize is None else {"auto_resize": body.auto_resize}))  # fmt: skip
    return Parsed(request, _size(width, height), "0", DEFAULT_FPS, body.timeout, sent)


def _shape_sent_as(body: _Body, card: ModelCard, image: Image.Image | None) -> tuple[int | None, int | None, SentAs]:
    """Width and height (for a request from `image`, None where the client sent none: the loop sizes
    it from the image, as the Python API's), and every Request field named as the client sent it."""
    with named_as_sent(body._sent):
        width, height, origin = pixel_size(body.size, body.width, body.height, card, body._sent)
    if image is not None:
        width, height = (width if "width" in origin else None), (height if "height" in origin else None)
    return width, height, {**body._sent, **origin}


def _size(width: int | None, height: int | None) -> str | None:
    return None if width is None or height is None else f"{width}x{height}"


def check_input_reference(data: bytes, card: ModelCard, takes_image: bool, field: str = "input_reference",
                          serve: str = "an image-to-video card") -> Image.Image:  # fmt: skip
    """An uploaded image (`field`: a video's input_reference, an edit's image). The served loop must
    take one (`Loop.takes_image`), checked before the upload is looked at; then it must be a PNG, JPEG
    or WebP (no other PIL plugin sees it) of at most MAX_REFERENCE_PIXELS pixels. Returns it as RGB,
    for `Request(image=...)`."""
    if not takes_image:
        raise RequestRejected(field, f"card {card.card_id!r} generates from text only and takes no image; "
                                     f"serve {serve} to use {field}")  # fmt: skip
    try:
        image = Image.open(io.BytesIO(data), formats=INPUT_IMAGE_FORMATS)  # reads the header only
        if image.width * image.height <= MAX_REFERENCE_PIXELS:
            image.load()
            return image.convert("RGB")
    except _UNDECODABLE as err:
        raise RequestRejected(field, f"is not a decodable image (PNG, JPEG, WebP): {err}") from None
    raise RequestRejected(field, f"{image.width}x{image.height} has more than {MAX_REFERENCE_PIXELS} pixels")


# What PIL raises for bytes it cannot open or decode (SyntaxError and EOFError from some truncated files).
_UNDECODABLE = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)
