"""Reading a saved loop state back: the file and each field are checked before a state is built.

A saved state is untrusted input (it may be empty, truncated, or edited). `read_saved_fields` loads
it with `weights_only=True` (no pickled code runs) and refuses, naming the file and the field, a
file torch cannot read, a payload of another shape, unknown or missing fields, and a field whose
value is not of its declared type. What the values mean (shapes, finiteness, progress) is the
loop's to check when the state is resumed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import torch


def read_saved_fields(cls: type, path: str | Path) -> dict[str, Any]:
    """The fields saved in `path` for dataclass `cls`; ValueError names the file and what is wrong."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # empty, truncated, not a torch file, or a blocked (unsafe) payload
        raise ValueError(f"{path}: not a readable saved state ({type(err).__name__}: {str(err)[:300]})") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("fields"), dict):
        raise ValueError(f"{path}: not a saved state (expected a dict with 'type' and 'fields')")
    if blob.get("type") != cls.__name__:
        raise ValueError(f"{path}: holds a {blob.get('type')!r}, expected a {cls.__name__}")
    return checked_fields(cls, blob["fields"], str(path))


def checked_fields(cls: type, fields: dict[str, Any], where: str, provided: tuple[str, ...] = ()) -> dict[str, Any]:
    """`fields` for dataclass `cls` once each is checked: known, present unless defaulted (or in
    `provided`, which the caller passes itself), of its declared type. A field whose metadata has a
    "load" reader is read back by it (a nested saved part: its reader checks it). ValueError names
    `where` and the field."""
    declared = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("transient") and f.name not in provided}
    unknown = sorted(str(name) for name in fields if name not in declared)
    if unknown:
        raise ValueError(f"{where}: unknown field {', '.join(unknown)} in a saved {cls.__name__}")
    required = [name for name, f in declared.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]  # fmt: skip
    missing = [name for name in required if name not in fields]
    if missing:
        raise ValueError(f"{where}: missing field {', '.join(missing)} in a saved {cls.__name__}")
    hints = typing.get_type_hints(cls)
    out = {}
    for name, value in fields.items():
        load = declared[name].metadata.get("load")
        if load is not None and value is not None:
            try:
                out[name] = load(value)
            except ValueError as err:
                raise ValueError(f"{where}: field {name}: {err}") from None
            continue
        if not _matches(value, hints[name]):
            raise ValueError(f"{where}: field {name} must be {_describe(hints[name])}, got {type(value).__name__}")
        out[name] = value
    return out


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and (not args or all(_matches(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict) and (not args or all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items()))
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a hint this reader does not know: the loop's own check decides


def _describe(hint: Any) -> str:
    return {int: "an int", float: "a number", str: "a str", bool: "a bool"}.get(hint, str(hint).replace("typing.", ""))
