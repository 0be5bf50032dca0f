"""`fvgraph serve-ray`: two tiny-wan replicas on CPU behind the HTTP API, driven by the official openai client.

Needs the ray extra (`pip install -e '.[test,ray]'`, as `make test` does); skipped where Ray is missing.
"""

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'fvgraph[ray]')")
from http_helpers import QUICK, client, httpx, openai  # noqa: E402

from fvgraph.serving.media_encode import decode_mp4  # noqa: E402
from fvgraph.serving.ray_deployment import REPLICA_HEADER  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
KEY = "ray-test-key"


def _quiet_port() -> int:
    """A free port in 20000 up to the kernel's ephemeral range: neither the kernel (for a connection or
    a bind to port 0) nor Ray (its workers take 10002-19999) hands it to the processes Ray starts, so
    none of them takes it before Ray Serve's proxy binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, max(low, 20001)), min(200, max(low - 20000, 1))):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in 20000..{low}")


def _launch(storage: Path, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "fvgraph", "serve-ray", "--replicas", "2", "--replica-cpus", "0.5",
               "--ray-address", "local", "--ray-cpus", "2", "-O0", "--device", "cpu", "--api-key", KEY, "--port", str(port),
               "--storage-dir", str(storage), "--drain-timeout", "0.05"]  # fmt: skip
    with open(log, "wb") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def _serving(process: subprocess.Popen, log: Path) -> bool:
    """True once the command says it serves; False when it exited 2 over its port (taken after the probe
    chose it); anything else fails the test."""
    deadline = time.monotonic() + 180
    while b"serving tiny-wan -O0 on Ray Serve" not in log.read_bytes():
        if process.poll() is not None:
            if process.returncode == 2 and "--port=" in log.read_text():
                return False
            raise AssertionError(f"fvgraph serve-ray exited {process.returncode}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"fvgraph serve-ray did not start:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return True


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:  # a test failed before the shutdown test: stop it, then make sure
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    """`fvgraph serve-ray` with 2 tiny-wan replicas at -O0 on a local Ray instance (no dashboard), in
    a process of its own; yields (base URL, the shared store, the process)."""
    storage = tmp_path_factory.mktemp("ray-videos")
    log = storage.parent / "serve-ray.log"
    for _ in range(3):  # a port another process took between the probe and the proxy's bind: another port
        port = _quiet_port()
        process = _launch(storage, port, log)
        try:
            if _serving(process, log):
                yield f"http://127.0.0.1:{port}", storage, process
                return
        finally:
            _stop(process)
    raise AssertionError(f"three ports were taken before fvgraph serve-ray bound them:\n{log.read_text()[-3000:]}")


def test_a_port_taken_while_ray_starts_exits_2_naming_it(tmp_path):
    """The port is free when the command checks it and taken when Ray Serve's proxy binds it: exit 2 with
    one line naming --port, and Ray shut down. (The check is made to pass: a socket holds the port.)"""
    script = (
        "import importlib, socket, sys\n"
        "from fvgraph.cli import app\n"
        "importlib.import_module('fvgraph.cli.options').bindable = lambda host, port: None\n"
        "holder = socket.socket(); holder.bind(('127.0.0.1', 0)); holder.listen()\n"
        "print('port', holder.getsockname()[1], flush=True)\n"
        "sys.argv = ['fvgraph', 'serve-ray', '--port', str(holder.getsockname()[1]), *sys.argv[1:]]\n"
        "app()\n"
    )
    args = ["--replicas", "1", "--replica-cpus", "0.5", "--ray-address", "local", "--ray-cpus", "1", "-O0",
            "--device", "cpu", "--storage-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=180)
    port = done.stdout.split()[1]
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, said[-3000:]
    assert f"error: --port={port}: Ray Serve's proxy cannot bind 127.0.0.1:{port}: another process took it" in said
    assert "Traceback" not in said


def test_eight_requests_over_http_complete_on_both_replicas_and_any_replica_serves_any_video(ray_app):
    url, storage, _ = ray_app
    api = client(url, KEY)

    def post(i: int):
        raw = api.videos.with_raw_response.create(prompt=f"fox {i}", size="32x32", seconds="1",
                                                  extra_body={**QUICK, "seed": i})  # fmt: skip
        return raw.parse().id, raw.headers[REPLICA_HEADER]

    # all at once, as clients arrive: the router sees calls in flight and spreads them
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made_by = dict(pool.map(post, range(8)))  # video id -> the replica whose engine runs it
    assert len(set(made_by.values())) == 2, f"Ray Serve sent every request to one replica: {made_by}"

    answered_by = set()  # the replicas that answered the polls: each reads videos the other made
    deadline = time.monotonic() + 60
    for video_id in made_by:
        while (raw := api.videos.with_raw_response.retrieve(video_id)).parse().status not in ("completed", "failed"):
            answered_by.add(raw.headers[REPLICA_HEADER])
            assert time.monotonic() < deadline, f"{video_id} did not finish"
            time.sleep(0.05)
        video = raw.parse()
        assert video.status == "completed", video.error
        assert decode_mp4(api.videos.download_content(video_id).read()).shape == (5, 32, 32, 3)
        record = json.loads((storage / f"{video_id}.json").read_text())
        assert record["owner"] == made_by[video_id] and record["status"] == "completed"

    listed = api.videos.list(limit=20).data
    assert {video.id for video in listed} >= set(made_by)
    assert answered_by <= set(made_by.values())
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.headers[REPLICA_HEADER] in set(made_by.values())


def _metric_on(url: str, replica: str, name: str) -> float:
    """`name` from the /metrics of `replica` (Ray Serve picks the replica per call: ask until it is that one)."""
    for _ in range(200):
        answer = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        if answer.headers[REPLICA_HEADER] == replica:
            return sum(float(line.split()[-1]) for line in answer.text.splitlines() if line.startswith(name))
    raise AssertionError(f"200 calls to /metrics never reached replica {replica}")


def test_a_delete_on_any_replica_cancels_the_running_video_on_the_replica_that_runs_it(ray_app):
    url, storage, _ = ray_app
    api = client(url, KEY)
    raw = api.videos.with_raw_response.create(prompt="a long one", size="256x256", seconds="8",
                                              extra_body={**QUICK, "num_inference_steps": 50})  # fmt: skip
    video, owner = raw.parse(), raw.headers[REPLICA_HEADER]
    cancelled = 'fvgraph_cancellations_total{reason="client"}'
    before = _metric_on(url, owner, cancelled)
    deadline = time.monotonic() + 30
    while api.videos.retrieve(video.id).progress == 0:
        assert time.monotonic() < deadline, "the video never started"
        time.sleep(0.05)

    deleted = api.videos.with_raw_response.delete(video.id)  # the maker or the other replica: either must do
    assert deleted.parse().deleted
    for _ in range(2):  # whichever replica answers, the video is gone
        with pytest.raises(openai.NotFoundError):
            api.videos.retrieve(video.id)
    while _metric_on(url, owner, cancelled) != before + 1:
        assert time.monotonic() < deadline + 30, "the replica running the video never cancelled it"
        time.sleep(0.1)
    assert _metric_on(url, owner, "fvgraph_running_requests") == 0
    # Whichever replica answered, the files are gone and a tombstone stays for the retention: it tells the
    # maker (when another replica deleted it) and keeps the video's place for pages whose cursor it was.
    assert {path.suffix for path in storage.glob(f"{video.id}*")} == {".deleted"}


def test_sigterm_drains_each_replica_records_its_unfinished_video_and_exits_0(ray_app):
    """Last in this module: SIGTERM while a long video runs. Each replica's drain (the app's ASGI
    lifespan, run by Ray Serve's shutdown) cancels it after --drain-timeout and records why in the
    shared store; the command exits 0."""
    url, storage, process = ray_app
    api = client(url, KEY)
    # 33 frames at 256x256, 50 steps: about 6 s of denoising on one CPU thread, far past the drain timeout
    video = api.videos.create(prompt="a long one", size="256x256", seconds="8", extra_body={**QUICK, "num_inference_steps": 50})
    deadline = time.monotonic() + 30
    while api.videos.retrieve(video.id).progress == 0:
        assert time.monotonic() < deadline, "the video never started"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    record = json.loads((storage / f"{video.id}.json").read_text())
    assert record["status"] == "failed" and record["error"]["code"] == "shutdown", record
    assert not list(storage.glob("*.partial")) and not list(storage.glob(f"{video.id}.mp4"))
