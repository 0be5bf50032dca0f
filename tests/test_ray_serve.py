"""Ray Serve: two tiny-wan replicas on CPU behind the HTTP API, driven by the official openai client.

Needs the ray extra (`pip install -e '.[test,ray]'`, as `make test` does); skipped where Ray is missing.
"""

import json
import socket
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'fvgraph[ray]')")
from http_helpers import QUICK, client, httpx  # noqa: E402
from ray import serve  # noqa: E402

from fvgraph.serving.http_app import HttpSettings  # noqa: E402
from fvgraph.serving.media_encode import decode_mp4  # noqa: E402
from fvgraph.serving.ray_deployment import REPLICA_HEADER, ReplicaSpec, build_app  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
KEY = "ray-test-key"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    """A local Ray instance (2 CPUs, no dashboard) serving 2 tiny-wan replicas at -O0; shut down after."""
    storage = tmp_path_factory.mktemp("ray-videos")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = ReplicaSpec(storage_dir=str(storage), card="tiny-wan", opt_level=0, device="cpu",
                           settings=HttpSettings(api_key=KEY, drain_timeout_s=0.05))  # fmt: skip
        app = build_app(spec, num_replicas=2, ray_actor_options={"num_cpus": 0.5})
        serve.run(app, name="fvgraph", route_prefix="/")
        yield f"http://127.0.0.1:{port}", storage
    finally:
        serve.shutdown()
        ray.shutdown()


def test_eight_requests_over_http_complete_on_both_replicas_and_any_replica_serves_any_video(ray_app):
    url, storage = ray_app
    api = client(url, KEY)
    made_by = {}  # video id -> the replica whose engine runs it (the replica that took the POST)
    for i in range(8):
        raw = api.videos.with_raw_response.create(prompt=f"fox {i}", size="32x32", seconds="1",
                                                  extra_body={**QUICK, "seed": i})  # fmt: skip
        made_by[raw.parse().id] = raw.headers[REPLICA_HEADER]
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


def test_shutdown_drains_each_replica_and_records_its_unfinished_video(ray_app):
    """Last in this module: Serve shuts down while a long video runs. The replica's drain (the app's
    ASGI lifespan) cancels it after drain_timeout_s and records why in the shared store."""
    url, storage = ray_app
    api = client(url, KEY)
    # 33 frames at 256x256, 50 steps: about 6 s of denoising on one CPU thread, far past the drain timeout
    video = api.videos.create(prompt="a long one", size="256x256", seconds="8", extra_body={**QUICK, "num_inference_steps": 50})
    deadline = time.monotonic() + 30
    while api.videos.retrieve(video.id).progress == 0:
        assert time.monotonic() < deadline, "the video never started"
        time.sleep(0.05)
    serve.shutdown()
    record = json.loads((storage / f"{video.id}.json").read_text())
    assert record["status"] == "failed" and record["error"]["code"] == "shutdown", record
    assert not list(storage.glob("*.partial")) and not list(storage.glob(f"{video.id}.mp4"))
