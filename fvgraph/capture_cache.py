"""CaptureCache: compiled step graphs on disk, so a process starts warm and never runs a wrong artifact.

    <root>/<fingerprint id>/manifest.json        what this process identity has compiled
    <root>/<fingerprint id>/<signature key>/<sha256>-step.pt2, <sha256>-prologue.pt2
    <root>/<fingerprint id>/.lock

The fingerprint is the process identity (toolchain, GPU, card, weights version, pass pipeline,
backend, opt level); a process reads only the directory of its own fingerprint. Inside, entries are
keyed by StepSignature key, and each records every factor of its signature, its artifacts' sizes and
sha256, and what rebuilding a CompiledStep needs. An entry is used only when its factors equal the
asking signature's and every artifact's size and hash check out; anything else (stale, foreign,
truncated, corrupted) is logged with the reason and rebuilt, never loaded.

Writers take the directory's file lock to publish; artifact files are named by their content hash
and renamed into place, and the manifest is replaced atomically, so readers need no lock. Two
warmups racing on one directory leave a valid cache: the first sound entry published for a key
stands, and the later writer runs that entry's artifacts instead of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"


def fingerprint_id(fingerprint: dict) -> str:
    blob = json.dumps({"format": FORMAT, **fingerprint}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _normalized(factors: dict) -> dict:
    """Factors as they read back from JSON (tuples become lists), for comparing with a manifest."""
    return json.loads(json.dumps(factors, default=str))


@dataclass(frozen=True)
class CacheEntry:
    key: str
    record: dict  # the manifest's entry: factors, artifacts, meta

    @property
    def meta(self) -> dict:
        return self.record["meta"]

    @property
    def artifact_names(self) -> list[str]:
        return list(self.record["artifacts"])


class CaptureCache:
    def __init__(self, root: str | Path, fingerprint: dict):
        self.root = Path(root)
        self.fingerprint = _normalized(fingerprint)
        self.dir = self.root / fingerprint_id(fingerprint)
        self._explained = False

    # -- reading -----------------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, directory: Path) -> CaptureCache:
        """The cache in `directory`, with the fingerprint its manifest records (for ls/verify/clear)."""
        cache = cls(directory.parent, cls._read_manifest(directory).get("fingerprint", {}))
        cache.dir, cache._explained = directory, True  # a tampered fingerprint need not hash to the name
        return cache

    def find(self, key: str) -> CacheEntry | None:
        """The manifest's entry for `key`, unverified (`check` says whether it may be used)."""
        entries = self.entries()
        if key in entries:
            return CacheEntry(key, entries[key])
        if not entries:
            self._explain_empty()
        return None

    def entries(self) -> dict[str, dict]:
        return self._read_manifest(self.dir).get("entries", {})

    def check(self, entry: CacheEntry, factors: dict | None = None) -> str | None:
        """Why this entry must not be used for a signature with `factors`, or None when it is sound."""
        try:
            return self._problem(entry.record, factors)
        except (KeyError, TypeError, AttributeError) as err:
            return f"malformed manifest entry ({err!r})"

    def _problem(self, record: dict, factors: dict | None) -> str | None:
        if factors is not None and record["factors"] != _normalized(factors):
            theirs, ours = record["factors"] or {}, _normalized(factors)
            differing = [f"{k}: {theirs.get(k)} != {v}" for k, v in ours.items() if theirs.get(k) != v]
            return "foreign entry, its signature differs in " + "; ".join(differing or ["(unreadable factors)"])
        for name, artifact in record["artifacts"].items():
            path = (self.dir / artifact["file"]).resolve()
            if self.dir.resolve() not in path.parents:
                return f"{name} artifact {artifact['file']!r} points outside the cache directory"
            if not path.is_file():
                return f"{name} artifact {artifact['file']} is missing"
            if path.stat().st_size != artifact["bytes"]:
                return f"{name} artifact {artifact['file']} is {path.stat().st_size} bytes, the manifest says {artifact['bytes']} (truncated?)"
            if file_sha256(path) != artifact["sha256"]:
                return f"{name} artifact {artifact['file']} does not match its sha256 in the manifest (corrupted)"
        return None

    def path(self, entry: CacheEntry, name: str) -> Path:
        return self.dir / entry.record["artifacts"][name]["file"]

    def _explain_empty(self) -> None:
        """Once per process: say why another fingerprint's entries (if any) cannot serve this one."""
        if self._explained:
            return
        self._explained = True
        for other in sorted(p for p in self.root.glob("*/" + MANIFEST) if p.parent != self.dir):
            theirs = self._read_manifest(other.parent).get("fingerprint", {})
            differing = [f"{k}: {theirs.get(k)} != {v}" for k, v in self.fingerprint.items() if theirs.get(k) != v]
            if theirs.get("card_id") == self.fingerprint.get("card_id"):
                log.warning("capture cache: %s was built for another process identity, not used: %s",
                            other.parent.name, "; ".join(differing))  # fmt: skip

    @staticmethod
    def _read_manifest(directory: Path) -> dict:
        path = directory / MANIFEST
        if not path.is_file():
            return {}
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}, this build reads {FORMAT}")
            return manifest
        except (ValueError, OSError) as err:
            log.warning("capture cache: %s is unreadable and is ignored (it will be rewritten): %s", path, err)
            return {}

    # -- writing -----------------------------------------------------------------------------------

    def staging_dir(self) -> contextlib.AbstractContextManager[str]:
        """A scratch directory on the cache's filesystem, so publishing is a rename."""
        self.dir.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=self.dir, prefix=".staging-")

    def publish(self, key: str, factors: dict, files: dict[str, Path], meta: dict) -> CacheEntry:
        """Move the staged artifact `files` into place and record them, unless a sound entry for `key`
        is already there (another process won the race): then that one stands and is returned, and
        the staged files are left to the staging directory's cleanup. A broken entry is replaced."""
        with self._locked():
            manifest = self._read_manifest(self.dir) or {"format": FORMAT, "fingerprint": self.fingerprint, "entries": {}}
            if key in manifest["entries"]:
                existing = CacheEntry(key, manifest["entries"][key])
                if self.check(existing, factors) is None:
                    return existing
            (self.dir / key).mkdir(parents=True, exist_ok=True)
            artifacts = {}
            for name, staged in files.items():
                digest = file_sha256(staged)
                relative = f"{key}/{digest[:16]}-{name}{staged.suffix}"
                os.replace(staged, self.dir / relative)
                artifacts[name] = {"file": relative, "sha256": digest, "bytes": (self.dir / relative).stat().st_size}
            record = {"factors": _normalized(factors), "artifacts": artifacts, "meta": meta, "created": time.time()}
            manifest["entries"][key] = record
            self._write_manifest(manifest)
            self._remove_unreferenced(key, manifest)
        return CacheEntry(key, record)

    def annotate(self, key: str, **facts: float) -> None:
        """Add facts measured after publishing (CUDA graph capture seconds) to `key`'s meta. Best
        effort: a cache this process may only read stays as it is."""
        try:
            with self._locked():
                manifest = self._read_manifest(self.dir)
                if key in manifest.get("entries", {}):
                    manifest["entries"][key]["meta"].update(facts)
                    self._write_manifest(manifest)
        except OSError as err:
            log.info("capture cache: could not record %s for %s: %s", sorted(facts), key, err)

    def _write_manifest(self, manifest: dict) -> None:
        staged = self.dir / f".{MANIFEST}.{os.getpid()}.tmp"
        staged.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(staged, self.dir / MANIFEST)

    def _remove_unreferenced(self, key: str, manifest: dict) -> None:
        """Artifacts of `key` that a replaced entry left behind (called under the lock)."""
        referenced = {a["file"] for a in manifest["entries"][key]["artifacts"].values()}
        for path in (self.dir / key).iterdir():
            if f"{key}/{path.name}" not in referenced:
                path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


# -- the `fvgraph cache` commands: every fingerprint directory under a root ------------------------


def cache_dirs(root: str | Path) -> list[CaptureCache]:
    """One CaptureCache per fingerprint directory under `root`."""
    return [CaptureCache.open_existing(m.parent) for m in sorted(Path(root).glob("*/" + MANIFEST))]


def verify(root: str | Path) -> list[str]:
    """Every problem found under `root`, one line each; empty when the whole cache is sound."""
    problems = []
    for cache in cache_dirs(root):
        if fingerprint_id(cache.fingerprint) != cache.dir.name:
            problems.append(f"{cache.dir.name}: recorded fingerprint does not hash to its directory name")
        for key, record in cache.entries().items():
            problem = cache.check(CacheEntry(key, record))
            if problem:
                problems.append(f"{cache.dir.name}/{key}: {problem}")
    return problems


def clear(root: str | Path) -> int:
    """Remove every fingerprint directory under `root` (files such as a README stay). Returns the count."""
    removed = 0
    for path in Path(root).iterdir() if Path(root).is_dir() else ():
        if path.is_dir() and ((path / MANIFEST).exists() or (path / ".lock").exists()):
            shutil.rmtree(path)
            removed += 1
    return removed
