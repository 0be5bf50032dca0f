"""A bounded load test on loopback: 64 concurrent openai clients with mixed shapes, steps and guidance,
a fifth of them deleted at random moments. Every request ends exactly once, nothing is lost, each
video holds its own request's content, /health answers throughout, and once the kept videos are
removed the process holds no more tensors, requests, results or loop states than before the load."""

import asyncio
import gc
import random
from collections import Counter

import numpy as np
import pytest
import torch
from http_helpers import httpx, openai, KEY, expected_video, live_server

from fvgraph.request import Request, Result
from fvgraph.serving.media_encode import decode_mp4

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CLIENTS = 64
SIZES = [(16, 16), (32, 16), (16, 32), (32, 32)]
FRAMES = [1, 5]
# What a request leaves behind if anything keeps it: its latents (a tensor), its Request, its Result
# (which holds the frames) and its loop state (the engine's loop's state_type). All are gc-tracked.
HELD_KINDS = (torch.Tensor, Request, Result)
# 64 clients polling share the GIL with the engine thread (server and clients are one process here):
# each poll costs the client and the server a few ms of Python.
POLL_S = 1.0


def _held(engine) -> Counter:
    """Live objects of HELD_KINDS and loop states, by kind, with the engine's projection cache emptied
    first (it keeps each prompt's projections on purpose, up to its byte budget)."""
    if engine.projection_cache is not None:
        engine.projection_cache.clear()
    gc.collect()
    kinds = (*HELD_KINDS, engine.loop.state_type)
    return Counter(kind.__name__ for obj in gc.get_objects() for kind in kinds if isinstance(obj, kind))


async def _client(api: openai.AsyncOpenAI, rng: random.Random, index: int, cancel: bool) -> dict:
    width, height = rng.choice(SIZES)
    frames = rng.choice(FRAMES)
    extra = {"num_frames": frames, "num_inference_steps": rng.randint(1, 3), "guidance_scale": rng.choice([1.0, 4.0]),
             "seed": index}  # fmt: skip
    video = await api.videos.create(prompt=f"client {index}", size=f"{width}x{height}", extra_body=extra)
    if cancel:
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        await api.videos.delete(video.id)
        with pytest.raises(openai.NotFoundError):
            await api.videos.retrieve(video.id)
        return {"id": video.id, "cancelled": True}
    while (video := await api.videos.retrieve(video.id)).status in ("queued", "in_progress"):
        await asyncio.sleep(POLL_S)
    assert video.status == "completed", video.error
    content = await api.videos.download_content(video.id)
    request = {"prompt": f"client {index}", "height": height, "width": width, **extra}
    return {"id": video.id, "cancelled": False, "video": decode_mp4(content.read()), "request": request}


async def _load(url: str, seed: int) -> tuple[list[dict], list[int]]:
    rng = random.Random(seed)
    cancelled = set(rng.sample(range(CLIENTS), CLIENTS // 5))
    health: list[int] = []
    stop = asyncio.Event()

    async def watch_health():
        async with httpx.AsyncClient() as http:
            while not stop.is_set():
                health.append((await http.get(url + "/health", timeout=5)).status_code)
                await asyncio.sleep(0.2)

    api = openai.AsyncOpenAI(api_key=KEY, base_url=url + "/v1", max_retries=0, timeout=120)
    watcher = asyncio.ensure_future(watch_health())
    outcomes = await asyncio.gather(*(_client(api, random.Random(rng.random()), i, i in cancelled) for i in range(CLIENTS)))
    stop.set()
    await watcher
    await api.close()
    return outcomes, health


async def _warm(url: str) -> None:
    api = openai.AsyncOpenAI(api_key=KEY, base_url=url + "/v1", max_retries=0, timeout=120)
    shapes = [(w, h, f, g) for w, h in SIZES for f in FRAMES for g in (1.0, 4.0)]
    made = await asyncio.gather(*(  # every step count too: the sampler keeps each count's plan (a few tensors)
        api.videos.create(prompt="warm", size=f"{w}x{h}", extra_body={"num_frames": f, "num_inference_steps": 1 + i % 3, "guidance_scale": g})
        for i, (w, h, f, g) in enumerate(shapes)
    ))  # fmt: skip
    for video in made:
        assert (await api.videos.poll(video.id, poll_interval_ms=100)).status == "completed"
        await api.videos.delete(video.id)
    await api.close()


def test_sixty_four_clients_a_fifth_cancelled_every_request_ends_once(tiny_engine, tmp_path):
    with live_server(tiny_engine, tmp_path) as (srv, url):
        ends: dict[str, list[str]] = {}
        srv.served.listeners.append(lambda e: ends.setdefault(e.request_id, []).append(e.kind) if e.terminal else None)
        asyncio.run(_warm(url))  # every shape once, so first-use costs fall before the baseline
        ends.clear()
        baseline = _held(tiny_engine)

        outcomes, health = asyncio.run(_load(url, seed=1))

        assert len({o["id"] for o in outcomes}) == CLIENTS
        assert set(ends) == {o["id"] for o in outcomes}
        assert all(len(kinds) == 1 for kinds in ends.values()), {k: v for k, v in ends.items() if len(v) != 1}
        for outcome in outcomes:  # a deleted request was cancelled, or had finished before the delete came
            assert ends[outcome["id"]][0] in (("cancelled", "done") if outcome["cancelled"] else ("done",))
        assert sum(o["cancelled"] for o in outcomes) == CLIENTS // 5
        assert health and set(health) == {200}
        assert srv.served.admission.reserved_bytes == 0 and srv.served.admission.queue_depth == 0
        assert srv.served.in_flight == 0
        kept = srv.store.page(None, 100, "desc")[0]
        assert len(kept) == CLIENTS - CLIENTS // 5 and all(v.status == "completed" for v in kept)
        for item in kept:
            srv.store.remove(item.id)
        assert not list(srv.store.root.iterdir())
        assert _held(tiny_engine) == baseline
    served = [o for o in outcomes if not o["cancelled"]]
    for outcome in served:  # each id's video is its own request's, not a neighbour's
        assert np.array_equal(outcome["video"], expected_video(tiny_engine, **outcome["request"])), outcome["request"]
    assert len({o["video"].tobytes() for o in served}) == len(served)  # and no two requests' videos are alike
