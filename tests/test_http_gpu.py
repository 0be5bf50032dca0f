"""On CUDA: the HTTP server's engine thread replays CUDA graphs (-O2) and compiles nothing after warmup."""

import numpy as np
import pytest
from http_helpers import QUICK, client, expected_video, httpx, live_server, wait_for

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.engine.engine import Engine
from fvgraph.serving.http_server import warmup_requests
from fvgraph.serving.media_encode import decode_mp4

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_gpu_http_serves_from_cuda_graphs_without_recompiling(tmp_path):
    engine = Engine.from_card("tiny-wan", device="cuda", opt_level=2, buckets=BucketSpec(batch_sizes=(1, 2)))
    warm = warmup_requests(engine.card, [(5, 32, 32)])
    with live_server(engine, tmp_path, warmup=warm) as (_, url):
        wait_for(lambda: httpx.get(url + "/ready").status_code == 200, timeout_s=600, what="the warmup")
        compiles, replays = engine.counters.compiles, engine.counters.replays
        api = client(url)
        extra = {**QUICK, "num_frames": 5, "num_inference_steps": 4, "guidance_scale": engine.card.recipe.default_guidance_scale}
        videos = [api.videos.create(prompt=f"gpu {i}", size="32x32", extra_body={**extra, "seed": i}) for i in range(3)]
        for video in videos:
            done = api.videos.poll(video.id, poll_interval_ms=50)
            assert done.status == "completed", done.error
        served = [decode_mp4(api.videos.download_content(video.id).read()) for video in videos]
        assert engine.counters.compiles == compiles and engine.counters.replays > replays
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer test-key"}).text
        assert "fvgraph_recompiles_total 0.0" in metrics
    # each id holds its own request's video: nearest to that request run directly (an eager engine
    # differs from the CUDA graphs in the last bits), farther from the others'
    direct = Engine.from_card("tiny-wan", device="cuda")
    expected = [expected_video(direct, prompt=f"gpu {i}", height=32, width=32, num_frames=5, num_inference_steps=4,
                               guidance_scale=extra["guidance_scale"], seed=i, fps=extra["fps"]) for i in range(3)]  # fmt: skip
    for i, video in enumerate(served):
        assert video.shape == (5, 32, 32, 3)
        distance = [np.abs(video.astype(int) - e.astype(int)).mean() for e in expected]
        assert min(range(3), key=distance.__getitem__) == i, distance
