"""SharedVideoStore: two servers on one directory answer for each other's videos."""

import json
import time

from fvgraph.serving.shared_video_store import SharedVideoStore
from fvgraph.serving.video_store import StoredVideo, VideoStore


def _stores(tmp_path, now, deleted=None):
    clock = lambda: now[0]  # noqa: E731
    a = SharedVideoStore(tmp_path, 10, owner="a", on_deleted_elsewhere=None if deleted is None else deleted.append, clock=clock)
    b = SharedVideoStore(tmp_path, 10, owner="b", clock=clock)
    return a, b


def _video(store, prompt="a fox"):
    return store.add(StoredVideo(VideoStore.new_id("video"), "video", "tiny-wan", prompt, "32x32", "1", 5, 4.0, 100))


def test_a_video_made_by_one_server_is_read_listed_and_served_by_the_other(tmp_path):
    now = [time.time()]
    a, b = _stores(tmp_path, now)
    first, second = _video(a, "one"), _video(b, "two")
    a.update(first.id, status="in_progress", progress=40)
    seen = b.get(first.id)
    assert (seen.status, seen.progress, seen.prompt) == ("in_progress", 40, "one")

    assert a.finish(first.id, "completed", content={"video": b"mp4 bytes", "thumbnail": b"jpg"})
    assert b.get(first.id).status == "completed" and b.get(first.id).progress == 100
    assert b.content(first.id, "video").read_bytes() == b"mp4 bytes"
    assert json.loads((tmp_path / f"{first.id}.json").read_text())["owner"] == "a"

    for store in (a, b):  # both see both, in the order they were made
        assert [item.id for item in store.page(None, 10, "asc")[0]] == [first.id, second.id]
        assert [item.id for item in store.page(None, 1, "desc")[0]] == [second.id]
        assert store.page(None, 1, "desc")[1] is True
        assert len(store) == 2


def test_a_delete_on_the_other_server_removes_the_video_and_tells_its_maker(tmp_path):
    now, deleted = [time.time()], []
    a, b = _stores(tmp_path, now, deleted)
    running, finished = _video(a), _video(a)
    a.finish(finished.id, "completed", content={"video": b"mp4"})

    assert b.remove(finished.id).id == finished.id
    assert b.get(finished.id) is None and not (tmp_path / f"{finished.id}.mp4").exists()
    assert a.get(finished.id) is None and deleted == [finished.id]

    b.remove(running.id)  # while it runs: its maker's next step event finds it gone and cancels it
    assert a.update(running.id, progress=50) is None and deleted == [finished.id, running.id]
    assert not a.finish(running.id, "completed", content={"video": b"late"})  # the end writes nothing back
    assert deleted == [finished.id, running.id]
    assert b.get(running.id) is None and not (tmp_path / f"{running.id}.json").exists()
    assert not list(tmp_path.glob(f"{running.id}.mp4")) and not list(tmp_path.glob("*.partial"))
    assert a.page(None, 10, "asc")[0] == []


def test_finished_videos_and_tombstones_expire_on_any_server(tmp_path):
    now = [time.time()]
    a, b = _stores(tmp_path, now)
    kept, gone, deleted = _video(a), _video(a), _video(a)
    a.finish(gone.id, "failed", error={"code": "generation_failed", "message": "x"})
    b.remove(deleted.id)
    now[0] += 11
    assert b.expire() == [gone.id]
    assert b.get(gone.id) is None and a.get(gone.id) is None and not (tmp_path / f"{gone.id}.json").exists()
    assert not (tmp_path / f"{deleted.id}.deleted").exists()
    assert b.get(kept.id).status == "queued"  # not ended: it never expires


def test_ids_that_are_not_the_servers_own_never_name_a_file(tmp_path):
    now = [time.time()]
    a, b = _stores(tmp_path, now)
    (tmp_path.parent / "secret.json").write_text(json.dumps({"id": "x"}))
    for bad in ("../secret", "video_123", "video_" + "g" * 32, ""):
        assert b.get(bad) is None and b.remove(bad) is None
    assert (tmp_path.parent / "secret.json").exists()
