"""A VideoStore that several servers share through one directory: any of them answers for any video.

    store = SharedVideoStore("/mnt/shared/videos", retention_s=3600, owner="replica-a")

Each server keeps its own videos in memory, as VideoStore does, and writes each one's record
(`{id}.json`, VideoStore's, plus the `owner`) next to its content files whenever it changes, its
progress included. Another server reads that record to answer GET, list and content calls for a video it did
not make. A DELETE on a server that did not make the video leaves a tombstone (`{id}.deleted`) and
removes the record and files; the maker sees the tombstone the next time it looks the video up (at
its next step event) and calls `on_deleted_elsewhere(id)`, which the Ray Serve replica uses to cancel
the request. Every removal of a video (a DELETE on any server, an expiry) leaves such a tombstone,
holding the video's sort key, so a page whose cursor was removed goes on from its position on every
server (VideoStore.page). Tombstones go after the retention, like finished records.

A server opened on the directory adopts nothing (VideoStore.adopt is for a server that is alone
on its folder): every server already reads every record from it, and expires the finished ones.

The directory must be one that every server sees (a local folder for replicas on one machine; a
network file system across machines). Ids stay the server's own: a client's string is a key to look
up, checked against the id pattern before it names a file.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from fvgraph.serving.video_store import ID_PATTERN, SortKey, StoredVideo, VideoStore, from_record, sort_key


class SharedVideoStore(VideoStore):
    def __init__(self, root: str | Path, retention_s: float, owner: str,
                 on_deleted_elsewhere: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time):  # fmt: skip
        """`owner` names this server in the records it writes; `on_deleted_elsewhere(id)` is called
        (on the thread that looked the video up) when another server deleted one of this server's videos."""
        self.owner = owner
        self.on_deleted_elsewhere = on_deleted_elsewhere
        super().__init__(root, retention_s, clock)

    def adopt(self) -> list[str]:
        """Nothing: the records in the directory are every server's, and every server reads them."""
        return []

    # -- this server's videos: VideoStore's, the record on disk written on every change --------------

    def update(self, item_id: str, **changes) -> StoredVideo | None:
        if self._deleted_elsewhere(item_id, tell=True):
            return None
        item = super().update(item_id, **changes)
        if item is not None and "status" not in changes:  # VideoStore wrote it for a status change
            self._persist(item_id)
        return item

    def finish(self, item_id: str, status, error: dict | None = None, content: dict[str, bytes] | None = None) -> bool:
        """As VideoStore.finish; False, writing nothing, for a video another server deleted (its request
        has ended: there is nothing left to cancel, so on_deleted_elsewhere is not called)."""
        if self._deleted_elsewhere(item_id, tell=False):
            return False
        kept = super().finish(item_id, status, error, content)
        if kept and self._deleted_elsewhere(item_id, tell=False):  # deleted while the files were written
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
        if not own:  # before the record goes: its maker must not write it back
            self._write_tombstone(item_id, None if item is None else sort_key(item))
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
        if tell and self.on_deleted_elsewhere is not None:
            self.on_deleted_elsewhere(item_id)
        return True

    def _tombstone(self, item_id: str) -> Path:
        return self.root / f"{item_id}.deleted"

    def _write_tombstone(self, item_id: str, key: SortKey | None) -> None:
        """`{id}.deleted`, holding the video's sort key when it is known (written whole, then renamed)."""
        path = self._tombstone(item_id)
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        partial.write_text("" if key is None else json.dumps(list(key)))
        os.replace(partial, path)

    def _remember_removed(self, item: StoredVideo) -> None:
        """Every server reads the sort key from the tombstone (VideoStore keeps it in memory)."""
        if item.object == "video":
            self._write_tombstone(item.id, sort_key(item))

    def _removed_key(self, item_id: str) -> SortKey | None:
        if not ID_PATTERN.fullmatch(item_id):
            return None
        try:
            added_ns, kept_id = json.loads(self._tombstone(item_id).read_text())
        except (FileNotFoundError, ValueError, TypeError):  # no tombstone, or one without a key
            return None
        return (added_ns, kept_id) if isinstance(added_ns, int) and kept_id == item_id else None

    def _to_record(self, item: StoredVideo) -> dict:
        return {**super()._to_record(item), "owner": self.owner}

    def _persist(self, item_id: str) -> None:
        with self._disk_lock:
            if not self._tombstone(item_id).exists():  # deleted by another server: its record stays gone
                super()._persist(item_id)

    def _read_record(self, item_id: str) -> dict | None:
        if self._tombstone(item_id).exists():
            return None
        try:
            return json.loads(self._record(item_id).read_text())
        except (FileNotFoundError, ValueError):  # never existed or deleted (writes are atomic: never torn)
            return None

    def _read(self, item_id: str) -> StoredVideo | None:
        record = self._read_record(item_id)
        return None if record is None else from_record(record, self.root)

    def _listed(self) -> list[StoredVideo]:
        """Every server's items, in the order they were added (oldest first): what `page` lists."""
        records = []
        for path in self.root.glob("*.json"):
            record = self._read_record(path.stem) if ID_PATTERN.fullmatch(path.stem) else None
            if record is not None:
                records.append(record)
        items = [item for record in records if (item := from_record(record, self.root)) is not None]
        return sorted(items, key=lambda item: (item.added_ns, item.id))
