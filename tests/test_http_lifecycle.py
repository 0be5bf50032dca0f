"""Content expires after the retention; a shutdown drains (503 for new requests) and loses nothing."""

import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from http_helpers import httpx, KEY, QUICK, client, expected_video, live_server, slow_steps, wait_for

from fvgraph.serving.media_encode import decode_mp4
from fvgraph.serving.video_store import StoredVideo, VideoStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_store_ids_are_the_servers_and_a_deleted_item_leaves_no_file(tmp_path):
    now = [1000.0]
    store = VideoStore(tmp_path, retention_s=10, clock=lambda: now[0])
    ids = {store.new_id("video") for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"video_[0-9a-f]{32}", i) for i in ids)
    kept, dropped = (store.add(StoredVideo(store.new_id("video"), "video", "m", "p", "32x32", "1", 5, 4.0, 1000)) for _ in range(2))
    store.remove(dropped.id)  # deleted while it ran: its content arrives afterwards
    assert not store.finish(dropped.id, "completed", content={"video": b"late"})
    assert store.finish(kept.id, "completed", content={"video": b"mp4", "thumbnail": b"jpg"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{kept.id}.jpg", f"{kept.id}.json", f"{kept.id}.mp4"]
    assert store.get(kept.id).expires_at == 1010
    now[0] = 1010.0
    assert store.expire() == [kept.id] and not list(tmp_path.iterdir())


def test_content_expires_after_the_retention_and_its_files_are_deleted(tiny_engine, tmp_path):
    with live_server(tiny_engine, tmp_path, retention_s=0.4) as (srv, url):
        api = client(url)
        video = api.videos.create_and_poll(prompt="brief", size="32x32", poll_interval_ms=20, extra_body={**QUICK, "num_frames": 1})
        assert video.status == "completed" and list(srv.store.root.glob(f"{video.id}.*"))
        wait_for(lambda: not list(srv.store.root.glob(f"{video.id}.*")), timeout_s=10, what="the files to expire")
        assert httpx.get(f"{url}/v1/videos/{video.id}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_a_restarted_server_serves_lists_and_deletes_the_videos_of_the_last_one(tiny_engine, tmp_path):
    with live_server(tiny_engine, tmp_path) as (_, url):
        video = client(url).videos.create_and_poll(prompt="kept", size="32x32", poll_interval_ms=20, extra_body=QUICK)
        mp4 = client(url).videos.download_content(video.id).read()
    with live_server(tiny_engine, tmp_path) as (srv, url):
        api = client(url)
        assert api.videos.retrieve(video.id).status == "completed"
        assert api.videos.download_content(video.id).read() == mp4
        assert [v.id for v in api.videos.list(limit=10).data] == [video.id]
        api.videos.delete(video.id)
        assert not list(srv.store.root.glob(f"{video.id}*"))


def test_drain_finishes_running_videos_cancels_what_outlasts_it_and_refuses_new_ones(tiny_engine, tmp_path, monkeypatch):
    slowed: set[str] = set()
    slow_steps(monkeypatch, tiny_engine, 0.2, only=slowed)  # the long one needs 10 s, and each tick 0.2 s
    with live_server(tiny_engine, tmp_path, drain_timeout_s=4.0) as (srv, url):
        api = client(url)
        long = api.videos.create(prompt="long", size="32x32", extra_body={**QUICK, "num_inference_steps": 50})
        slowed.add(long.id)
        short = api.videos.create(prompt="short", size="32x32", extra_body={**QUICK, "num_inference_steps": 4, "num_frames": 5})
        # the signal comes when the short one is half done: it needs about 3 more ticks, the long one 45
        wait_for(lambda: api.videos.retrieve(long.id).status == "in_progress" and api.videos.retrieve(short.id).progress >= 50,
                 what="both to run")  # fmt: skip
        srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        wait_for(lambda: srv.server.draining, what="draining")
        refused = httpx.post(url + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"}, data={"prompt": "late"})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(url + "/ready").status_code == 503
        wait_for(lambda: not srv.served.accepting and srv.served.in_flight == 0, what="the drain")
    done, cut = srv.store.get(short.id), srv.store.get(long.id)
    assert done.status == "completed", done.error
    assert np.array_equal(decode_mp4(done.files["video"].read_bytes()),
                          expected_video(tiny_engine, fps=4, prompt="short", height=32, width=32, num_frames=5,
                                         num_inference_steps=4, seed=1))  # fmt: skip
    assert cut.status == "failed" and cut.error["code"] == "shutdown" and not cut.files
    kept = [f"{short.id}.jpg", f"{short.id}.json", f"{short.id}.mp4", f"{short.id}.sprites.jpg",
            f"{long.id}.json"]  # a failed video keeps its record
    assert sorted(p.name for p in srv.store.root.iterdir()) == sorted(kept)


def test_serve_port_refuses_bad_options_by_name(tmp_path):
    from typer.testing import CliRunner

    from fvgraph.cli import app

    result = CliRunner().invoke(app, ["serve", "-O0", "--port", "0", "--memory-budget", "lots", "-o", str(tmp_path)])
    assert result.exit_code == 2 and "--memory-budget='lots' must be a size such as 8GiB" in result.output
    result = CliRunner().invoke(app, ["serve", "-O0", "--port", "0", "--warmup-shape", "9x64", "-o", str(tmp_path)])
    assert result.exit_code == 2 and "--warmup-shape='9x64' must be FRAMESxHEIGHTxWIDTH" in result.output
    for value in ("inf", "nan"):  # every finished video would fail computing its expiry
        result = CliRunner().invoke(app, ["serve", "-O0", "--port", "0", "--retention-s", value, "-o", str(tmp_path)])
        assert result.exit_code == 2 and "(--retention-s) must be a finite, positive number" in result.output, result.output


def test_serve_port_in_use_exits_2_before_the_engine_loads(tmp_path, monkeypatch):
    import importlib
    import socket

    from typer.testing import CliRunner

    from fvgraph.cli import app

    serve = importlib.import_module("fvgraph.cli.serve")  # the module: fvgraph.cli.serve names the command
    monkeypatch.setattr(serve, "serving_engine", lambda *args, **kwargs: pytest.fail("the engine loaded for a port in use"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "-O0", "--port", str(port), "-o", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"--port={port}: cannot bind 127.0.0.1:{port}: Address already in use" in " ".join(result.output.split())


def test_sigterm_stops_the_cli_server_cleanly(tmp_path):
    command = [sys.executable, "-m", "fvgraph", "serve", "-O0", "--port", "0", "-o", str(tmp_path), "--drain-timeout", "10"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "FVGRAPH_API_KEY": KEY})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    try:
        url = wait_for(lambda: next((m[1] for line in lines if (m := re.search(r"on (http://\S+)/v1", line))), None),
                       timeout_s=120, what="the server to listen")  # fmt: skip
        api = client(url)
        video = api.videos.create(prompt="before the signal", size="32x32", extra_body={**QUICK, "num_frames": 1})
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=5)
    assert any("draining" in line for line in lines)
    assert decode_mp4((tmp_path / f"{video.id}.mp4").read_bytes()).shape[0] == 1  # it finished before the exit
