"""The server's videos and images: their status as the OpenAI Video object, and their content on disk.

Ids are made here (`video_` + 32 hex digits, or `img_...`); a client's string is only ever a key to
look up, never part of a path. Content is written to a temporary file and renamed into place, and a
video is marked completed only once all of its files are there, so no partial file is ever served.
A finished item expires `retention_s` after it ended: `expire()` deletes its record and its files.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["queued", "in_progress", "completed", "failed"]
# variant -> file suffix; the only names content files ever get besides the server's ids
VARIANTS = {"video": "mp4", "thumbnail": "jpg", "image": "png"}


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

    def to_json(self) -> dict:
        """The OpenAI Video object (the fields its SDK reads)."""
        return {
            "id": self.id, "object": "video", "status": self.status, "progress": self.progress,
            "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": self.expires_at,
            "model": self.model, "size": self.size, "seconds": self.seconds, "prompt": self.prompt,
            "error": self.error, "remixed_from_video_id": None,
        }  # fmt: skip


class VideoStore:
    def __init__(self, root: str | Path, retention_s: float, clock: Callable[[], float] = time.time):
        if retention_s <= 0:
            raise ValueError(f"retention_s={retention_s} must be positive")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.retention_s = retention_s
        self.clock = clock
        self._items: dict[str, StoredVideo] = {}  # insertion order is creation order
        self._lock = threading.Lock()

    @staticmethod
    def new_id(kind: Literal["video", "image"]) -> str:
        return ("video_" if kind == "video" else "img_") + secrets.token_hex(16)

    def add(self, item: StoredVideo) -> StoredVideo:
        with self._lock:
            self._items[item.id] = item
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
            return item

    def finish(self, item_id: str, status: Status, error: dict | None = None, content: dict[str, bytes] | None = None) -> bool:
        """Write `content` (variant -> bytes) atomically, then mark the item ended. False when the item
        was deleted meanwhile: then nothing is left on disk."""
        files = {}
        for variant, data in (content or {}).items():
            path = self.root / f"{item_id}.{VARIANTS[variant]}"
            partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
            partial.write_bytes(data)
            os.replace(partial, path)
            files[variant] = path
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
        return item is not None

    def remove(self, item_id: str) -> StoredVideo | None:
        """Forget an item and delete its files."""
        with self._lock:
            item = self._items.pop(item_id, None)
        if item is not None:
            _unlink(item.files.values())
        return item

    def content(self, item_id: str, variant: str) -> Path | None:
        item = self.get(item_id)
        if item is None or item.status != "completed":
            return None
        return item.files.get(variant)

    def page(self, after: str | None, limit: int, order: Literal["asc", "desc"]) -> tuple[list[StoredVideo], bool]:
        """Videos newest first (or oldest first), starting after the id `after`; and whether more follow."""
        self.expire()
        items = [item for item in self._listed() if item.object == "video"]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise KeyError(after)
            items = items[ids.index(after) + 1 :]
        return items[:limit], len(items) > limit

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


def _unlink(paths) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
