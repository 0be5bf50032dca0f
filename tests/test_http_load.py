"""A bounded load test on loopback: 64 concurrent openai clients with mixed shapes, steps and guidance,
a fifth of them deleted at random moments. Every request ends exactly once, nothing is lost, the
cancelled ones free their memory, /health answers throughout and the process returns to its baseline."""

import asyncio
import ctypes
import gc
import os
import random

import pytest
from http_helpers import httpx, openai, KEY, live_server

from fvgraph.serving.media_encode import decode_mp4

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CLIENTS = 64
SIZES = [(16, 16), (32, 16), (16, 32), (32, 32)]
FRAMES = [1, 5]
# Growth of the resident set allowed after a load round, once the same round has run before: the
# allocator keeps some freed pages; a leak of every request's frames or latents would exceed it.
RSS_SLACK_BYTES = 96 << 20
# 64 clients polling share the GIL with the engine thread (server and clients are one process here):
# each poll costs the client and the server a few ms of Python.
POLL_S = 1.0


def _rss() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so the figure means something
    except OSError:
        pass
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    assert decode_mp4(content.read()).shape == (frames, height, width, 3)
    return {"id": video.id, "cancelled": False}


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
    made = await asyncio.gather(*(
        api.videos.create(prompt="warm", size=f"{w}x{h}", extra_body={"num_frames": f, "num_inference_steps": 1, "guidance_scale": g})
        for w, h in SIZES for f in FRAMES for g in (1.0, 4.0)
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
        baseline = _rss()

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
        assert _rss() - baseline < RSS_SLACK_BYTES
