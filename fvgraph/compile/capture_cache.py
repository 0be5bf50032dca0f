"""CaptureCache: compiled step graphs on disk, so a process starts warm and never runs a wrong artifact.

    <root>/<fingerprint id>/manifest.json        what this process identity has compiled
    <root>/<fingerprint id>/<signature key>/<sha256>-step.pt2, <sha256>-prologue.pt2
    <root>/<fingerprint id>/.lock

The fingerprint is the process identity (toolchain, GPU, card, weights version, pass pipeline,
backend, opt level); a process reads only the directory of its own fingerprint. Inside, entries are
keyed by StepSignature key, and each records every factor of its signature, its artifacts' sizes and
sha256, and what rebuilding a CompiledStep needs. An entry is used only when its factors equal the
asking signature's and every artifact's size and hash check out; anything else (stale, foreign,
truncated, corrupted) is logged with the reason and rebuilt, never loaded. The metadata a load uses
(parameter, input and output names, hoisted value shapes) is hashed like the artifacts.

Writers take the directory's file lock to publish; artifact files are named by their content hash
and renamed into place, and the manifest is replaced atomically, so readers need no lock. Two
warmups racing on one directory leave a valid cache: the first sound entry published for a key
stands, and the later writer runs that entry's artifacts instead of its own, unless that writer
found the entry unusable itself (its files hash right but no longer load): then it replaces it.
A writer waits for the lock at most `LOCK_TIMEOUT_S`, saying after `LOCK_NOTICE_S` whom it waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fvgraph.compile.capture_cache_files import MANIFEST, STAGING, entry_problem, manifest_problem, orphans, size_of, staging_prefix

log = logging.getLogger(__name__)

FORMAT = 1
# Publishing holds the lock for a rename and a manifest write: a holder past these is stuck or slow.
LOCK_NOTICE_S = 5.0
LOCK_TIMEOUT_S = 120.0


FINGERPRINT_NAME = re.compile(r"[0-9a-f]{20}")  # what fingerprint_id returns


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


def meta_digest(meta: dict) -> str:
    """sha256 of what loading an entry reads from its meta: all of it but the measured `*_seconds`
    (annotated after publishing, and read only by `cache ls`)."""
    loaded = {key: value for key, value in meta.items() if not key.endswith("_seconds")}
    return hashlib.sha256(json.dumps(loaded, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


class CaptureCache:
    def __init__(self, root: str | Path, fingerprint: dict):
        self.root = Path(root)
        self.fingerprint = _normalized(fingerprint)
        self.dir = self.root / fingerprint_id(fingerprint)
        self._explained = self._foreign_noted = False  # each said once per process
        self.lock_notice_s, self.lock_timeout_s = LOCK_NOTICE_S, LOCK_TIMEOUT_S
        self.problems: list[str] = []  # what reading the manifest skipped (malformed parts), for verify

    # -- reading -----------------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, directory: Path) -> CaptureCache:
        """The cache in `directory`, with the fingerprint its manifest records (for ls/verify/clear)."""
        problems: list[str] = []
        cache = cls(directory.parent, cls._read_manifest(directory, problems).get("fingerprint", {}))
        cache.dir, cache._explained = directory, True  # a tampered fingerprint need not hash to the name
        cache.problems = problems
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
        return self._own_manifest().get("entries", {})

    def _own_manifest(self) -> dict:
        """The manifest, or {} when the fingerprint it records is not this cache's (edited, or copied
        from another process identity's directory): none of its entries is used, and the next writer
        starts it again."""
        manifest = self._read_manifest(self.dir)
        if manifest and manifest["fingerprint"] != self.fingerprint:
            if self._foreign_noted:
                return {}
            self._foreign_noted, theirs = True, manifest["fingerprint"]
            differing = [f"{k}: {theirs.get(k)} != {v}" for k, v in self.fingerprint.items() if theirs.get(k) != v]
            log.warning("capture cache: manifest %s records another fingerprint, its entries are not used (it will be "
                        "rewritten): %s", self.dir / MANIFEST, "; ".join(differing or ["(other factors)"]))  # fmt: skip
            return {}
        return manifest

    def unloadable(self, key: str, factors: dict) -> str | None:
        """Why the artifacts built for `key` (with these factors) did not load here, when they did not
        (`mark_unloadable`); None otherwise."""
        record = self.unloadable_keys().get(key)
        if record is not None and record.get("factors") == _normalized(factors):
            return str(record.get("problem"))
        return None

    def unloadable_keys(self) -> dict[str, dict]:
        """Every mark_unloadable record, by signature key (for `cache ls`)."""
        marks = self._own_manifest().get("unloadable")
        return {k: v for k, v in marks.items() if isinstance(v, dict)} if isinstance(marks, dict) else {}

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
        if record.get("meta_sha256") != meta_digest(record["meta"]):
            if "meta_sha256" not in record:
                return "its metadata (meta) has no meta_sha256 to check it against (an entry of an older build)"
            return "its metadata (meta) does not match its meta_sha256 in the manifest (edited or corrupted)"
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
    def _read_manifest(directory: Path, problems: list[str] | None = None) -> dict:
        """The manifest, its malformed entries left out; {} when it is missing or unreadable (wrong
        JSON, or valid JSON of the wrong shape). Each problem is logged, and added to `problems`."""
        path = directory / MANIFEST
        if not path.is_file():
            return {}
        try:
            manifest = json.loads(path.read_text())
            problem = manifest_problem(manifest, FORMAT)
            if problem is not None:
                raise ValueError(problem)
        except (ValueError, OSError, RecursionError) as err:
            log.warning("capture cache: manifest %s is unreadable and is ignored (it will be rewritten): %s", path, err)
            if problems is not None:
                problems.append(f"manifest is unreadable and will be rewritten: {err}")
            return {}
        for key, record in list(manifest["entries"].items()):
            problem = entry_problem(record)
            if problem is not None:
                log.warning("capture cache: manifest %s: entry %s is malformed and is ignored: %s", path, key, problem)
                if problems is not None:
                    problems.append(f"manifest entry {key} is malformed and will be rebuilt: {problem}")
                del manifest["entries"][key]
        return manifest

    # -- writing -----------------------------------------------------------------------------------

    def staging_dir(self) -> contextlib.AbstractContextManager[str]:
        """A scratch directory on the cache's filesystem, so publishing is a rename."""
        self.dir.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=self.dir, prefix=staging_prefix())

    def publish(self, key: str, factors: dict, files: dict[str, Path], meta: dict, replace: dict | None = None) -> CacheEntry:
        """Move the staged artifact `files` into place and record them, unless a sound entry for `key`
        is already there (another process won the race): then that one stands and is returned, and
        the staged files are left to the staging directory's cleanup. A broken entry is replaced, and
        so is `replace`, an entry record the caller found unusable though its files hash right."""
        with self._locked():
            manifest = self._own_manifest() or {"format": FORMAT, "fingerprint": self.fingerprint, "entries": {}}
            if key in manifest["entries"]:
                existing = CacheEntry(key, manifest["entries"][key])
                if self.check(existing, factors) is None and existing.record != replace:
                    return existing
            (self.dir / key).mkdir(parents=True, exist_ok=True)
            artifacts = {}
            for name, staged in files.items():
                digest = file_sha256(staged)
                relative = f"{key}/{digest[:16]}-{name}{staged.suffix}"
                os.replace(staged, self.dir / relative)
                artifacts[name] = {"file": relative, "sha256": digest, "bytes": (self.dir / relative).stat().st_size}
            record = {"factors": _normalized(factors), "artifacts": artifacts, "meta": meta,
                      "meta_sha256": meta_digest(meta), "created": time.time()}  # fmt: skip
            manifest["entries"][key] = record
            if isinstance(manifest.get("unloadable"), dict):  # artifacts of this key load after all
                manifest["unloadable"].pop(key, None)
            self._write_manifest(manifest)
            self._remove_unreferenced(key, manifest)
        return CacheEntry(key, record)

    def mark_unloadable(self, key: str, factors: dict, problem: str) -> None:
        """Record that the artifacts just built for `key` did not load in this process identity (the
        AOTInductor loader crashing on a GPU): later processes compile that step in process rather
        than build them again, minutes each, only to see them fail. A new fingerprint (another torch,
        GPU or card) starts without marks, and `cache clear` forgets them. Best effort, like annotate."""
        try:
            with self._locked():
                manifest = self._own_manifest() or {"format": FORMAT, "fingerprint": self.fingerprint, "entries": {}}
                if not isinstance(manifest.get("unloadable"), dict):
                    manifest["unloadable"] = {}
                manifest["unloadable"][key] = {"factors": _normalized(factors), "problem": problem[:4000], "when": time.time()}
                self._write_manifest(manifest)
        except OSError as err:
            log.info("capture cache: could not record that %s does not load: %s", key, err)

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
        """The directory's file lock, waited for at most `lock_timeout_s` (TimeoutError naming the lock
        and its holder); the holder writes its pid and host into the lock file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / ".lock"
        with open(path, "a+") as lock:
            began, noticed = time.monotonic(), False
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = time.monotonic() - began
                    holder = (path.read_text().strip() or "an unknown process")[:200]
                    if waited >= self.lock_timeout_s:
                        raise TimeoutError(f"capture cache: the lock {path} is still held by {holder} after "
                                           f"{waited:.0f} s; not waiting any longer") from None  # fmt: skip
                    if not noticed and waited >= self.lock_notice_s:
                        noticed = True
                        log.warning("capture cache: waiting for the lock %s, held by %s (giving up after %.0f s)",
                                    path, holder, self.lock_timeout_s)  # fmt: skip
                    time.sleep(0.05)
            try:
                lock.seek(0)
                lock.truncate()
                lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
                lock.flush()
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


# -- the `fvgraph cache` commands: every fingerprint directory under a root ------------------------


def _is_fingerprint_dir(path: Path) -> bool:
    """A fingerprint id for a name, a manifest, a lock or a staging directory marks one, even one whose
    warmup never published or whose manifest was deleted. A symbolic link is never one (see cache_links)."""
    if path.is_symlink() or not path.is_dir():
        return False
    return (FINGERPRINT_NAME.fullmatch(path.name) is not None or (path / MANIFEST).exists()
            or (path / ".lock").exists() or any(p.name.startswith(STAGING) for p in path.iterdir()))  # fmt: skip


def cache_links(root: str | Path) -> list[Path]:
    """Symbolic links under `root` named like a fingerprint directory or pointing at a directory. The
    cache commands never follow them: what a link points to is not this cache's to list or remove."""
    root = Path(root)
    return [p for p in sorted(root.iterdir() if root.is_dir() else ())
            if p.is_symlink() and (FINGERPRINT_NAME.fullmatch(p.name) is not None or p.is_dir())]  # fmt: skip


def link_problem(link: Path) -> str:
    return (f"{link.name} is a symbolic link (to {os.readlink(link)}), not followed: the cache holds no links; "
            "remove the link, or point --cache-dir at what it links to")  # fmt: skip


def cache_dirs(root: str | Path) -> list[CaptureCache]:
    """One CaptureCache per fingerprint directory under `root`."""
    root = Path(root)
    return [CaptureCache.open_existing(p) for p in sorted(root.iterdir() if root.is_dir() else ()) if _is_fingerprint_dir(p)]


def leftovers(cache: CaptureCache) -> list[Path]:
    """Files under `cache.dir` that its manifest does not account for (see capture_cache_files.orphans)."""
    return orphans(cache.dir, cache.entries())


def verify(root: str | Path, load: bool = True) -> list[str]:
    """Every problem found under `root`, one line each; empty when the whole cache is sound. Each
    entry's artifacts are hashed and, with `load`, loaded as a serving process would load them."""
    problems = [link_problem(link) for link in cache_links(root)]
    for cache in cache_dirs(root):
        problems += [f"{cache.dir.name}: {problem}" for problem in cache.problems]
        if cache.fingerprint and fingerprint_id(cache.fingerprint) != cache.dir.name:
            problems.append(f"{cache.dir.name}: recorded fingerprint does not hash to its directory name")
        for key, record in cache.entries().items():
            problem = cache.check(CacheEntry(key, record))
            if problem is None and load:
                problem = _load_problem(cache, CacheEntry(key, record))
            if problem:
                problems.append(f"{cache.dir.name}/{key}: {problem}")
        for path in leftovers(cache):
            problems.append(f"{cache.dir.name}: {path.relative_to(cache.dir)} ({size_of(path)} bytes) is left over: "
                            "no entry uses it and no running writer owns it (`fvgraph cache clear` removes it)")  # fmt: skip
    return problems


def _load_problem(cache: CaptureCache, entry: CacheEntry) -> str | None:
    from fvgraph.compile.graph_artifact import probe_load

    kind = str(cache.fingerprint.get("artifact_kind", cache.fingerprint.get("backend")))  # what the entries were stored as
    for name in entry.artifact_names:
        try:
            probe_load(cache.path(entry, name), kind)
        except Exception as err:  # its hash checks out, but a serving process could not run it
            return f"{name} artifact does not load: {str(err)[:300]}"
    return None


def clear(root: str | Path) -> int:
    """Remove every fingerprint directory under `root` (files such as a README stay, and symbolic links
    with what they point to: see cache_links). Returns the count."""
    removed = 0
    for path in Path(root).iterdir() if Path(root).is_dir() else ():
        if _is_fingerprint_dir(path):
            shutil.rmtree(path)
            removed += 1
    return removed
