"""The fields other clients send, read onto fvgraph's request bodies, and errors named as they were sent.

OpenAI's SDK sends `size` ("WIDTHxHEIGHT"), `seconds` and, for images, fields that set how the
hosted model renders (quality, style, background, moderation). The peers' servers (SGLang's and
vLLM-Omni's) take the diffusers names as top-level fields or inside an `extra_params` object:
width, height, num_frames, fps, guidance_scale, guidance_scale_2, negative_prompt, seed,
num_inference_steps, and flow_shift / boundary_ratio, which fvgraph fixes when the server starts.

A Request's field and the field the client sent can differ: `size` sets height and width,
`seconds` the frame count, `extra_params.seed` the seed. `SentAs` maps one to the other, so that a
refusal of the request's `width` reaches the client as a refusal of its `size` (docs/serving.md,
"Fields each client sends").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

from fvgraph.card import ModelCard
from fvgraph.request import RequestRejected

# WIDTHxHEIGHT, read case- and space-insensitively ("832X480", " 832 x 480 ").
SIZE = re.compile(r"\s*([1-9][0-9]{0,4})\s*[xX]\s*([1-9][0-9]{0,4})\s*")
# The peers' extension fields each endpoint reads, at the top level or in `extra_params`.
VIDEO_EXTENSIONS = ("width", "height", "num_frames", "fps", "guidance_scale", "guidance_scale_2", "true_cfg_scale", "flow_shift",
                    "boundary_ratio", "negative_prompt", "seed", "num_inference_steps", "strength", "preview_every")  # fmt: skip
IMAGE_EXTENSIONS = tuple(name for name in VIDEO_EXTENSIONS if name not in ("num_frames", "fps", "strength", "preview_every"))
# Sampler settings fixed when the server starts: a request that sets one is refused, naming the flag.
DEPLOY_TIME = {"flow_shift": "--flow-shift", "boundary_ratio": "--boundary-ratio"}

SentAs = dict[str, str]  # a Request's (or body's) field -> the field the client sent it as


def fold_extra_params(fields: dict, takes: tuple[str, ...]) -> tuple[dict, SentAs]:
    """`fields` with the keys of its `extra_params` object moved to the top level, and where each
    came from. A key that is not one of `takes` is refused as `extra_params.KEY`; so is one also
    sent at the top level with another value. A form sends the object as JSON text or as bracketed
    keys (`extra_params[seed]=42`, folded already by nested_form_fields)."""
    if fields.get("extra_params") is None:
        return {name: value for name, value in fields.items() if name != "extra_params"}, {}
    extra = fields["extra_params"]
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            extra = None
    if not isinstance(extra, dict):
        raise RequestRejected("extra_params", 'must be a JSON object of extension fields, e.g. {"num_frames": 33, "seed": 1}')
    out = {name: value for name, value in fields.items() if name != "extra_params"}
    sent: SentAs = {}
    for key, value in extra.items():
        if key not in takes:
            raise RequestRejected(f"extra_params.{key}", f"is not a field extra_params takes here; it takes {', '.join(takes)}")
        if key in out and out[key] != value:
            raise RequestRejected(f"extra_params.{key}", f"={value!r} conflicts with {key}={out[key]!r} sent at the "
                                                         "top level; send it once")  # fmt: skip
        out[key], sent[key] = value, f"extra_params.{key}"
    return out, sent


@contextmanager
def named_as_sent(sent: SentAs, notes: dict[str, str] | None = None) -> Iterator[None]:
    """Re-raise a RequestRejected of a field the client sent under another name (`size` for `width`)
    under the client's name, saying which of the request's fields it set; `notes` says how a
    field's value was derived (a frame count rounded to the card's rule)."""
    try:
        yield
    except RequestRejected as err:
        top = err.field.split(".")[0]
        client, note = sent.get(top), (notes or {}).get(top)
        if (client is None or client == top) and note is None:
            raise
        rule = str(err)[len(err.field) + 2 :].removeprefix("Value error, ")  # RequestRejected's text is "FIELD: RULE"
        client = client or top
        said = rule if client in (top, f"extra_params.{top}") else f"sets the request's {err.field}; {rule}"
        raise RequestRejected(client, said + ("" if note is None else f" ({note})")) from None


def pixel_size(size: str | None, width: int | None, height: int | None, card: ModelCard, sent: SentAs) -> tuple[int, int, SentAs]:
    """(width, height) from `size` ("WxH", or "auto" / none for the card's default) and the peers'
    `width` / `height`, which may replace size or agree with it; and the fields each came from."""
    given: dict[str, int] = {}
    origin: SentAs = {}
    if size is not None and size.strip().lower() != "auto":
        match = SIZE.fullmatch(size)
        if match is None:
            raise RequestRejected("size", f"{size!r} must be WIDTHxHEIGHT in pixels, e.g. "
                                          f"{card.shapes.default_width}x{card.shapes.default_height}, or 'auto'")  # fmt: skip
        given = {"width": int(match[1]), "height": int(match[2])}
        origin = {"width": "size", "height": "size"}
    for name, value in (("width", width), ("height", height)):
        if value is None:
            continue
        if name in given and given[name] != value:
            raise RequestRejected(sent.get(name, name), f"{name}={value} conflicts with size={size!r} ({name} "
                                                        f"{given[name]}); send one of them, or make them agree")  # fmt: skip
        given.setdefault(name, value)
        origin.setdefault(name, sent.get(name, name))
    return (given.get("width", card.shapes.default_width), given.get("height", card.shapes.default_height), origin)


def nearest_frame_count(exact: float, temporal_multiple: int) -> int:
    """The frame count nearest `exact` that the card allows, k * temporal_multiple + 1, ties going up
    (vLLM-Omni's 32 frames become 33, 80 become 81; 3 becomes 5 at a multiple of 4)."""
    k = max(0, int((exact - 1) / temporal_multiple + 0.5))
    return k * temporal_multiple + 1


def refuse_deploy_time(values: dict[str, object], card: ModelCard) -> None:
    """flow_shift and boundary_ratio are the served card's, chosen when the server starts."""
    served = {"flow_shift": card.recipe.sampler.config.get("flow_shift"), "boundary_ratio": card.recipe.boundary_ratio}
    for name, flag in DEPLOY_TIME.items():
        if values.get(name) is not None:
            now = "" if served[name] is None else f"; this server runs {name}={served[name]:g}"
            raise RequestRejected(name, f"is a deploy-time choice here (fvgraph serve {flag}{now}): a request cannot "
                                        "set it, so leave it out")  # fmt: skip
