"""A VideoStore that several servers share through one directory: any of them answers for any video.

    store = SharedVideoStore("/mnt/shared/videos", retention_s=3600, owner="replica-a")

Each server keeps its own videos in memory, as VideoStore does, and also writes each one's record
(`{id}.json`, written to a temporary file and renamed into place) next to its content files whenever
it changes. Another server reads that record to answer GET, list and content calls for a video it did
not make. A DELETE on a server that did not make the video leaves a tombstone (`{id}.deleted`) and
removes the record and files; the maker sees the tombstone the next time it looks the video up (at
its next step event) and calls `on_deleted_elsewhere(id)`, which the Ray Serve replica uses to cancel
the request. Tombstones go after the retention, like finished records.

The directory must be one that every server sees (a local folder for replicas on one machine; a
network file system across machines). Ids stay the server's own: a client's string is a key to look
up, checked against the id pattern before it names a file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

from fvgraph.serving.video_store import StoredVideo, VideoStore

ID_PATTERN = re.compile(r"(video|img)_[0-9a-f]{32}(-[0-9]+)?")  # VideoStore.new_id (+ "-i" for n > 1 images)
_FIELDS = {f.name for f in fields(StoredVideo)}


class SharedVideoStore(VideoStore):
    def __init__(self, root: str | Path, retention_s: float, owner: str,
                 on_deleted_elsewhere: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time):  # fmt: skip
        """`owner` names this server in the records it writes; `on_deleted_elsewhere(id)` is called
        (on the thread that looked the video up) when another server deleted one of this server's videos."""
        super().__init__(root, retention_s, clock)
        self.owner = owner
        self.on_deleted_elsewhere = on_deleted_elsewhere
        self._disk_lock = threading.Lock()  # one record write at a time: the last write has the newest state
        self._added_ns: dict[str, int] = {}  # when each of this server's items was added: the list's order

    # -- this server's videos: VideoStore's, plus the record on disk ---------------------------------

    def add(self, item: StoredVideo) -> StoredVideo:
        with self._lock:
            self._added_ns[item.id] = time.time_ns()
        super().add(item)
        self._persist(item.id)
        return item

    def update(self, item_id: str, **changes) -> StoredVideo | None:
        if self._deleted_elsewhere(item_id, tell=True):
            return None
        item = super().update(item_id, **changes)
        if item is not None:
            self._persist(item_id)
        return item

    def finish(self, item_id: str, status, error: dict | None = None, content: dict[str, bytes] | None = None) -> bool:
        """As VideoStore.finish; False, writing nothing, for a video another server deleted (its request
        has ended: there is nothing left to cancel, so on_deleted_elsewhere is not called)."""
        if self._deleted_elsewhere(item_id, tell=False):
            return False
        kept = super().finish(item_id, status, error, content)
        if kept:
            self._persist(item_id)
            if self._deleted_elsewhere(item_id, tell=False):  # deleted while the files were written
                return False
        return kept

    # -- any server's videos -------------------------------------------------------------------------

    def get(self, item_id: str) -> StoredVideo | None:
        if not ID_PATTERN.fullmatch(item_id):
            return None
        if self._deleted_elsewhere(item_id, tell=True):
            return None
        with self._lock:
            own = item_id in self._items
        if own:
            return super().get(item_id)
        item = self._read(item_id)
        if item is not None and item.expire_after is not None and item.expire_after <= self.clock():
            self.remove(item_id)
            return None
        return item

    def remove(self, item_id: str) -> StoredVideo | None:
        if not ID_PATTERN.fullmatch(item_id):
            return None
        with self._lock:
            own = item_id in self._items
        item = super().remove(item_id) if own else self._read(item_id)
        if not own:
            self._tombstone(item_id).touch()  # before the record goes: its maker must not write it back
        with self._lock:
            self._added_ns.pop(item_id, None)
        if item is not None:
            for path in item.files.values():
                path.unlink(missing_ok=True)
        self._record(item_id).unlink(missing_ok=True)
        return item

    def expire(self) -> list[str]:
        """Delete every video (of any server) whose retention has passed, and tombstones as old."""
        now = self.clock()
        gone = [item.id for item in self._listed() if item.expire_after is not None and item.expire_after <= now]
        for item_id in gone:
            self.remove(item_id)
        for tombstone in self.root.glob("*.deleted"):
            try:
                if tombstone.stat().st_mtime + self.retention_s <= now:
                    tombstone.unlink(missing_ok=True)
            except FileNotFoundError:  # another server expired it first
                pass
        return gone

    def __len__(self) -> int:
        return len(self._listed())

    # -- records -------------------------------------------------------------------------------------

    def _deleted_elsewhere(self, item_id: str, tell: bool) -> bool:
        """Whether one of this server's videos was deleted by another server; if so, forget it and
        delete its files here too, and (`tell`) call on_deleted_elsewhere."""
        with self._lock:
            own = item_id in self._items
        if not own or not self._tombstone(item_id).exists():
            return False
        super().remove(item_id)
        with self._lock:
            self._added_ns.pop(item_id, None)
        if tell and self.on_deleted_elsewhere is not None:
            self.on_deleted_elsewhere(item_id)
        return True

    def _record(self, item_id: str) -> Path:
        return self.root / f"{item_id}.json"

    def _tombstone(self, item_id: str) -> Path:
        return self.root / f"{item_id}.deleted"

    def _persist(self, item_id: str) -> None:
        with self._disk_lock:
            with self._lock:
                item = self._items.get(item_id)
                record = None if item is None else _to_record(item, self.owner, self._added_ns.get(item_id, 0))
            if record is None or self._tombstone(item_id).exists():
                return
            path = self._record(item_id)
            partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
            partial.write_text(json.dumps(record))
            os.replace(partial, path)

    def _read_record(self, item_id: str) -> dict | None:
        if self._tombstone(item_id).exists():
            return None
        try:
            return json.loads(self._record(item_id).read_text())
        except (FileNotFoundError, ValueError):  # never existed or deleted (writes are atomic: never torn)
            return None

    def _read(self, item_id: str) -> StoredVideo | None:
        record = self._read_record(item_id)
        return None if record is None else _from_record(record, self.root)

    def _listed(self) -> list[StoredVideo]:
        """Every server's items, in the order they were added (oldest first): what `page` lists."""
        records = []
        for path in self.root.glob("*.json"):
            record = self._read_record(path.stem) if ID_PATTERN.fullmatch(path.stem) else None
            if record is not None:
                records.append(record)
        records.sort(key=lambda record: (record.get("added_ns", 0), record["id"]))
        return [_from_record(record, self.root) for record in records]


def _to_record(item: StoredVideo, owner: str, added_ns: int) -> dict:
    record = asdict(item)
    record["files"] = {variant: path.name for variant, path in item.files.items()}
    record["owner"], record["added_ns"] = owner, added_ns
    return record


def _from_record(record: dict, root: Path) -> StoredVideo:
    values = {name: value for name, value in record.items() if name in _FIELDS}
    values["files"] = {variant: root / name for variant, name in record.get("files", {}).items()}
    return StoredVideo(**values)
