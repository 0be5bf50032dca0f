"""Errors in the flags' own words: a Request field's validation error, as the command line says it.

    Request(num_inference_steps=0)  ->  pydantic's dump naming num_inference_steps, with a link
    flag_error(err)                 ->  "--steps: must be >= 1"

One line: the first error (and how many more), the flag for the field, the rule, no pydantic link.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

# Request's fields -> the flags of `fvgraph generate` that set them.
REQUEST_FLAGS = {
    "prompt": "--prompt", "negative_prompt": "--negative-prompt", "num_inference_steps": "--steps",
    "guidance_scale": "--guidance", "true_cfg_scale": "--true-cfg", "height": "--height", "width": "--width",
    "num_frames": "--frames", "seed": "--seed", "cache": "--cache", "loras": "--lora-scale",
}  # fmt: skip
# Fields whose names are words of the rules' prose ("an image-to-video card", "from its video"): their
# flags name the field an error is about, and the prose keeps its words.
MEDIA_FLAGS = {"image": "--image", "video": "--video", "strength": "--strength"}

_RULES = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}


def in_flag_words(text: str, flags: dict[str, str] = REQUEST_FLAGS) -> str:
    """`text` with each field name (num_frames, num_frames=5) replaced by its flag (--frames, --frames=5)."""
    if not flags:
        return text
    pattern = re.compile(r"(?<![\w-])(" + "|".join(re.escape(name) for name in sorted(flags, key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda match: flags[match[1]], text)


def flag_error(err: BaseException, flags: dict[str, str] = REQUEST_FLAGS) -> str:
    """One line for a user of the command line: which flag, what rule."""
    # Imported where an error is worded, not at the top: the request schema brings torch, which
    # `fvgraph --help` must not load (issue 50; tests/test_light_import.py).
    from fvgraph.request import RequestRejected

    if isinstance(err, ValidationError):
        errors = err.errors(include_url=False)
        first = errors[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        name = _flag(field, flags)
        if first["type"] in _RULES:
            key, sign = _RULES[first["type"]]
            rule = f"must be {sign} {first['ctx'][key]}"
        else:
            rule = in_flag_words(first["msg"].removeprefix("Value error, ").replace("Input should be", "must be"), flags)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"{name}: {rule}{more}" if name else f"{rule}{more}"
    if isinstance(err, RequestRejected):
        message = str(err).removeprefix(f"{err.field}: ")
        return f"{_flag(err.field, flags)}: {in_flag_words(message, flags)}"
    return str(err)


def _flag(field: str, flags: dict[str, str]) -> str:
    """The flag that sets `field` (the field's own name where none does)."""
    return flags.get(field) or MEDIA_FLAGS.get(field, field)
