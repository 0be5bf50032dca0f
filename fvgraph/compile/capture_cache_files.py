"""What a capture cache directory may hold, and what is left over in it.

The rules a manifest must follow to be read at all (a manifest that is valid JSON of the wrong shape
is treated like an unreadable one: ignored, reported, rebuilt by the next writer), and the files no
manifest entry accounts for: staging directories and temporary manifests of a process that is gone
(a warmup killed mid-compile), artifacts a replaced entry left behind, entry directories with no
entry, symbolic links (never followed). Liveness is judged by process id, so it holds for writers on
this host.
"""

from __future__ import annotations

import os
from pathlib import Path

MANIFEST = "manifest.json"
STAGING = ".staging-"


def manifest_problem(manifest: object, expected_format: int) -> str | None:
    """Why this parsed manifest cannot be read at all, or None."""
    if not isinstance(manifest, dict):
        return f"must be a JSON object, got {type(manifest).__name__}"
    if manifest.get("format") != expected_format:
        return f"format {str(manifest.get('format'))[:40]!r}, this build reads {expected_format}"
    for name in ("fingerprint", "entries"):
        if not isinstance(manifest.get(name), dict):
            return f"{name} must be an object, got {type(manifest.get(name)).__name__}"
    return None


def entry_problem(record: object) -> str | None:
    """Why this manifest entry is malformed (it is then skipped, as if absent), or None."""
    if not isinstance(record, dict):
        return f"entry must be an object, got {type(record).__name__}"
    for name in ("factors", "artifacts", "meta"):
        if not isinstance(record.get(name), dict):
            return f"entry's {name} must be an object, got {type(record.get(name)).__name__}"
    for name, artifact in record["artifacts"].items():
        if not isinstance(artifact, dict) or not isinstance(artifact.get("file"), str) \
                or not isinstance(artifact.get("sha256"), str) or type(artifact.get("bytes")) is not int:  # fmt: skip
            return f"artifact {str(name)[:40]!r} must record file, sha256 and bytes"
    return None


def staging_prefix() -> str:
    """Staging directories carry their writer's pid, so a dead writer's leftovers can be told apart."""
    return f"{STAGING}{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # it exists, under another user
    except (OSError, OverflowError, ValueError):
        return False
    return True


def _writer_gone(name: str) -> bool:
    """For `.staging-<pid>-...` and `.manifest.json.<pid>.tmp`: whether that writer is gone."""
    parts = name.removeprefix(STAGING).split("-", 1) if name.startswith(STAGING) else name.split(".")[-2:-1]
    return not (parts and parts[0].isdigit() and pid_alive(int(parts[0])))


def orphans(directory: Path, entries: dict[str, dict]) -> list[Path]:
    """Files and folders under a fingerprint directory that no entry of `entries` accounts for."""
    found = []
    referenced = {artifact["file"] for record in entries.values() for artifact in record["artifacts"].values()}
    for path in sorted(directory.iterdir()) if directory.is_dir() else ():
        if path.is_symlink():  # never followed: the link itself is what is left over
            found.append(path)
        elif path.name.startswith(STAGING) or (path.name.startswith(f".{MANIFEST}.") and path.name.endswith(".tmp")):
            if _writer_gone(path.name):
                found.append(path)
        elif path.is_dir() and not path.name.startswith("."):
            stray = [p for p in sorted(path.iterdir()) if f"{path.name}/{p.name}" not in referenced]
            found += [path] if path.name not in entries and len(stray) == len(list(path.iterdir())) else stray
    return found


def size_of(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
