"""The server's videos and images: their status as the OpenAI Video object, and their content on disk.

Ids are made here (`video_` + 32 hex digits, or `img_...`); a client's string is only ever a key to
look up, never part of a path. Content is written to a temporary file and renamed into place, and a
video is marked completed only once all of its files are there, so no partial file is ever served;
a write that fails removes what it wrote. A finished item expires `retention_s` after it ended:
`expire()` deletes its record and its files.

Each item's record (`{id}.json`, the StoredVideo's fields) lies beside its files, written the same
way whenever the item is added, changes status or ends. A store opened on a folder adopts the
records an earlier server left there (`adopt()`): finished items are served, listed and expired as
before; an item that had not finished is adopted as failed (code `interrupted`: its request died
with the server); a record that cannot be read, or a completed one whose files are gone, is removed
with its files, and so are content files without a record and partial files. Files whose names are
not the store's (`ID_PATTERN` and a suffix of VARIANTS, or .json) are never touched.

`page` lists videos by their sort key, (added_ns, id): the time the store took each one, to the
nanosecond, then its id. A cursor (`after`) is a video id; the page starts after the cursor's
position in that order, so it goes on when the cursor's video was deleted or expired meanwhile: the
store keeps the sort key of each video it removed (`_remember_removed`) for `retention_s` after its
removal, in memory (a restarted server has forgotten them: a cursor removed before the restart is
refused, as an id it never listed is).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

Status = Literal["queued", "in_progress", "completed", "failed"]
# variant -> file suffix; the only names content files ever get besides the server's ids
VARIANTS = {"video": "mp4", "thumbnail": "jpg", "spritesheet": "sprites.jpg", "image": "png", "image_jpeg": "jpeg",
            "image_webp": "webp"}
IMAGE_VARIANTS = {"png": "image", "jpeg": "image_jpeg", "webp": "image_webp"}  # an image's output_format -> its variant
ID_PATTERN = re.compile(r"(video|img)_[0-9a-f]{32}(-[0-9]+)?")  # new_id (+ "-i" for image i of n > 1)
INTERRUPTED = {"code": "interrupted", "message": "the server stopped before this video finished; create it again"}


@dataclass
class StoredVideo:
    id: str
    object: Literal["video", "image"]
    model: str
    prompt: str
    size: str  # "WxH"
    seconds: str
    num_frames: int
    fps: float
    created_at: int
    status: Status = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict | None = None  # {"code", "message"} as OpenAI's VideoCreateError
    files: dict[str, Path] = field(default_factory=dict)
    expire_after: float | None = None  # clock time it expires (expires_at is its whole second, for the API)
    added_ns: int = 0  # when the store took it (time.time_ns()): the order it is listed in
    remixed_from: str | None = None  # the video this one remixes (POST /v1/videos/{id}/remix)
    settings: dict | None = None  # what a remix of it reuses (fvgraph.serving.video_remix); None: not remixable

    def to_json(self) -> dict:
        """The OpenAI Video object (the fields its SDK reads)."""
        return {
            "id": self.id, "object": "video", "status": self.status, "progress": self.progress,
            "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": self.expires_at,
            "model": self.model, "size": self.size, "seconds": self.seconds, "prompt": self.prompt,
            "error": self.error, "remixed_from_video_id": self.remixed_from,
            "num_frames": self.num_frames,  # what was rendered: the count asked for, rounded to one the card allows
        }  # fmt: skip


SortKey = tuple[int, str]


def sort_key(item: StoredVideo) -> SortKey:
    """The order `page` lists in: when the store took the item, then its id (for equal times)."""
    return item.added_ns, item.id


class VideoStore:
    def __init__(self, root: str | Path, retention_s: float, clock: Callable[[], float] = time.time):
        """Opens (or makes) `root` and adopts what an earlier server left in it."""
        if not (math.isfinite(retention_s) and retention_s > 0):  # inf would make every expiry time overflow
            raise ValueError(f"retention_s={retention_s} (--retention-s) must be a finite, positive number of seconds")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.retention_s = retention_s
        self.clock = clock
        self._items: dict[str, StoredVideo] = {}  # insertion order is creation order
        self._removed: dict[str, tuple[SortKey, float]] = {}  # removed video's id -> (its sort key, forget at)
        self._lock = threading.Lock()
        self._disk_lock = threading.RLock()  # a record is written or deleted under it: a delete is never undone
        self.adopt()

    @staticmethod
    def new_id(kind: Literal["video", "image"]) -> str:
        return ("video_" if kind == "video" else "img_") + secrets.token_hex(16)

    def add(self, item: StoredVideo) -> StoredVideo:
        item.added_ns = item.added_ns or time.time_ns()
        with self._lock:
            self._items[item.id] = item
        self._persist(item.id)
        return item

    def get(self, item_id: str) -> StoredVideo | None:
        with self._lock:
            item = self._items.get(item_id)
        if item is not None and item.expire_after is not None and item.expire_after <= self.clock():
            self.remove(item_id)
            return None
        return item

    def __len__(self) -> int:
        return len(self._items)

    def update(self, item_id: str, **fields) -> StoredVideo | None:
        """Change an item's fields; None (and nothing changed) if it was deleted meanwhile."""
        with self._lock:
            item = self._items.get(item_id)
            if item is not None:
                for name, value in fields.items():
                    setattr(item, name, value)
        if item is not None and "status" in fields:  # progress alone is not worth a write: it is lost on restart
            self._persist(item_id)
        return item

    def finish(self, item_id: str, status: Status, error: dict | None = None, content: dict[str, bytes] | None = None) -> bool:
        """Write `content` (variant -> bytes) atomically, then mark the item ended. False when the item
        was deleted meanwhile: then nothing is left on disk."""
        files = {}
        try:
            for variant, data in (content or {}).items():
                files[variant] = _write_atomically(self.root / f"{item_id}.{VARIANTS[variant]}", data)
        except BaseException:  # a full disk: nothing of this item stays behind
            _unlink(files.values())
            raise
        now = self.clock()
        with self._lock:
            item = self._items.get(item_id)
            if item is not None:
                item.files, item.status, item.error = files, status, error
                item.progress = 100 if status == "completed" else item.progress
                item.completed_at, item.expire_after = int(now), now + self.retention_s
                item.expires_at = math.ceil(item.expire_after)
        if item is None:
            _unlink(files.values())
        else:
            self._persist(item_id)
        return item is not None

    def remove(self, item_id: str) -> StoredVideo | None:
        """Forget an item and delete its record and files."""
        with self._disk_lock:
            with self._lock:
                item = self._items.pop(item_id, None)
            if item is not None:
                _unlink([*item.files.values(), self._record(item_id)])
        if item is not None and item.object == "video":
            self._remember_removed(item)
        return item

    def content(self, item_id: str, variant: str) -> Path | None:
        item = self.get(item_id)
        if item is None or item.status != "completed":
            return None
        return item.files.get(variant)

    def page(self, after: str | None, limit: int, order: Literal["asc", "desc"]) -> tuple[list[StoredVideo], bool]:
        """Videos newest first (or oldest first) by sort key, starting after the position of the video
        `after` (listed now, or removed: see the module docstring); and whether more follow. KeyError
        for an `after` the store does not know."""
        self.expire()
        items = sorted((item for item in self._listed() if item.object == "video"), key=sort_key,
                       reverse=order == "desc")  # fmt: skip
        if after is not None:
            cursor = next((sort_key(item) for item in items if item.id == after), None) or self._removed_key(after)
            if cursor is None:
                raise KeyError(after)
            items = [item for item in items if (sort_key(item) > cursor if order == "asc" else sort_key(item) < cursor)]
        return items[:limit], len(items) > limit

    def _remember_removed(self, item: StoredVideo) -> None:
        """Keep a removed video's sort key, so a page after it still has a position."""
        now = self.clock()
        with self._lock:
            self._removed[item.id] = (sort_key(item), now + self.retention_s)
            while True:  # forget what has been kept long enough, oldest first (the order they were added)
                oldest, (_, until) = next(iter(self._removed.items()))
                if until > now:
                    break
                del self._removed[oldest]

    def _removed_key(self, item_id: str) -> SortKey | None:
        with self._lock:
            kept = self._removed.get(item_id)
        return None if kept is None or kept[1] <= self.clock() else kept[0]

    def _listed(self) -> list[StoredVideo]:
        """The items `page` lists, oldest first: this store's own."""
        with self._lock:
            return list(self._items.values())

    def expire(self) -> list[str]:
        """Delete every item whose retention has passed; returns their ids."""
        now = self.clock()
        with self._lock:
            gone = [i for i, item in self._items.items() if item.expire_after is not None and item.expire_after <= now]
        for item_id in gone:
            self.remove(item_id)
        return gone


    # -- records on disk -----------------------------------------------------------------------------

    def _record(self, item_id: str) -> Path:
        return self.root / f"{item_id}.json"

    def _to_record(self, item: StoredVideo) -> dict:
        """What `{id}.json` holds: the item's fields, its files by name."""
        record = asdict(item)
        record["files"] = {variant: path.name for variant, path in item.files.items()}
        return record

    def _persist(self, item_id: str) -> None:
        """Write the item's record, unless it was removed meanwhile."""
        with self._disk_lock:
            with self._lock:
                item = self._items.get(item_id)
                record = None if item is None else self._to_record(item)
            if record is not None:
                _write_atomically(self._record(item_id), json.dumps(record).encode())

    def adopt(self) -> list[str]:
        """Take over the records in `root` (see the module's docstring); returns the ids adopted."""
        now, adopted = self.clock(), []
        for path in sorted(self.root.glob("*.json"), key=lambda p: p.name):
            if not ID_PATTERN.fullmatch(path.stem):
                continue
            item = from_record(_read_json(path), self.root)
            if item is None or item.id != path.stem or (item.status == "completed" and not item.files) or \
                    not all(p.is_file() for p in item.files.values()):  # fmt: skip
                _unlink([path, *(self.root / f"{path.stem}.{suffix}" for suffix in VARIANTS.values())])
                continue
            if item.status not in ("completed", "failed"):  # its request died with the earlier server
                _unlink(item.files.values())
                item.files, item.status, item.error = {}, "failed", dict(INTERRUPTED)
                item.completed_at, item.expire_after = int(now), now + self.retention_s
                item.expires_at = math.ceil(item.expire_after)
            adopted.append(item)
        with self._lock:
            for item in sorted(adopted, key=lambda item: (item.added_ns, item.created_at, item.id)):
                self._items.setdefault(item.id, item)
        for item in adopted:
            self._persist(item.id)
        self._remove_strays()
        return [item.id for item in adopted]

    def _remove_strays(self) -> None:
        """Content files no record names, and partial files a write left when the server died."""
        with self._lock:
            named = {path.name for item in self._items.values() for path in item.files.values()}
        for path in self.root.iterdir():
            stem, _, suffix = path.name.partition(".")
            ours = ID_PATTERN.fullmatch(stem) and suffix in VARIANTS.values() and path.name not in named
            partial = path.name.startswith(".") and path.name.endswith(".partial") and \
                ID_PATTERN.fullmatch(path.name[1:].partition(".")[0])  # fmt: skip
            if ours or partial:
                path.unlink(missing_ok=True)


_FIELDS = {f.name for f in fields(StoredVideo)}


def from_record(record: object, root: Path) -> StoredVideo | None:
    """The item a record describes; None for one that is not a record of this store's shape."""
    if not isinstance(record, dict) or not isinstance(record.get("files", {}), dict):
        return None
    values = {name: value for name, value in record.items() if name in _FIELDS}
    files = record.get("files", {})
    if not all(variant in VARIANTS and isinstance(name, str) and name == f"{record.get('id')}.{VARIANTS[variant]}"
               for variant, name in files.items()):  # fmt: skip
        return None  # a record names only its own content files: nothing else is ever served or deleted
    values["files"] = {variant: root / name for variant, name in files.items()}
    try:
        item = StoredVideo(**values)
    except TypeError:  # a field missing
        return None
    if not (isinstance(item.id, str) and item.object in ("video", "image") and
            item.status in ("queued", "in_progress", "completed", "failed")):  # fmt: skip
        return None
    return item


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # deleted meanwhile, torn by a crash, or not JSON
        return None


def _write_atomically(path: Path, data: bytes) -> Path:
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _unlink(paths) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
