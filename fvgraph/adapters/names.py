"""The rule an adapter's name follows, wherever a name comes in: loading an adapter, or a request choosing one."""

from __future__ import annotations

import re

NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RULE_TEXT = "must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"


def bad_name(name) -> str | None:
    """Why `name` is not an adapter name (None: it is one), quoting at most its first 64 characters."""
    if isinstance(name, str) and NAME_RULE.fullmatch(name):
        return None
    shown = repr(name[:64]) + f"... ({len(name)} characters)" if isinstance(name, str) and len(name) > 64 else repr(name)
    return f"lora name {shown} {RULE_TEXT}"
