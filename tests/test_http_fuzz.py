"""Fuzzing the HTTP server: whatever a body holds (random JSON, deep nesting, wrong types, booleans
for numbers, huge or odd values, as JSON or as a form), every answer is a success or a 4xx in the
OpenAI shape naming a field the client sent, never a 500, and the server serves on."""

from __future__ import annotations

import json
import random

import pytest
from http_helpers import httpx, KEY, client, live_server, wait_for
from test_serve_fuzz import random_json

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
HEADERS = {"Authorization": f"Bearer {KEY}"}
TINY = {"prompt": "a fox", "size": "16x16", "num_inference_steps": 1}
VIDEO_FIELDS = ["num_frames", "seconds", "fps", "num_inference_steps", "guidance_scale", "seed", "timeout", "cache",
                "size", "model", "prompt", "negative_prompt", "colour"]  # fmt: skip
IMAGE_FIELDS = ["n", "response_format", "num_inference_steps", "guidance_scale", "seed", "cache", "size", "prompt"]
ODD = [True, False, None, 0, -1, 1.5, 2**63, 2**70, 1e308, -0.0, "", "8", "abc", "x" * 5000, [], {}, [1, 2],
       {"method": ["magcache"]}, {"method": "magcache", "mag_ratios": "[1]"}, "magcache:mag_ratios=" + "[" * 3000,
       "0x0", "99999x99999", "16x16x16", 0.0001, 121, "NaN", "inf"]  # fmt: skip
# Besides the fields sent, an error may name the required one (prompt) and the ones the server derives
# from what was sent: size gives width and height, seconds the frame count, the shape a memory estimate.
NAMED = {"prompt", "width", "height", "num_frames", "memory_budget", "body"}


def deep(rng: random.Random) -> str:
    n = rng.choice([40, 1200, 20_000])
    return rng.choice(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n])


def fuzz_call(rng: random.Random) -> tuple[str, dict, set[str]]:
    """(path, httpx keyword arguments, the names the client sent)."""
    path = rng.choice(["/v1/videos", "/v1/videos", "/v1/images/generations"])
    names = VIDEO_FIELDS if path == "/v1/videos" else IMAGE_FIELDS
    roll = rng.random()
    if roll < 0.15:
        body = random_json(rng)
        sent = set(body) if isinstance(body, dict) else set()
        return path, {"content": json.dumps(body).encode(), "headers": {"Content-Type": "application/json"}}, sent
    if roll < 0.25:
        field = rng.choice(names)
        text = '{"prompt": "a fox", "%s": %s}' % (field, deep(rng))
        return path, {"content": text.encode(), "headers": {"Content-Type": "application/json"}}, {"prompt", field}
    body = dict(TINY, **({"num_frames": 1} if path == "/v1/videos" else {}))
    for _ in range(rng.randrange(0, 3)):
        body[rng.choice(names)] = rng.choice(ODD + [random_json(rng)])
    if rng.random() < 0.3 and path == "/v1/videos":  # as the SDK sends it: a multipart form of strings
        form = {k: v if isinstance(v, str) else json.dumps(v) for k, v in body.items()}
        return path, {"files": {k: (None, v) for k, v in form.items()}}, set(form)
    return path, {"content": json.dumps(body).encode(), "headers": {"Content-Type": "application/json"}}, set(body)


def check_answer(response: httpx.Response, sent: set[str]) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["param"] is None or body["error"]["param"] in sent | NAMED, (body, sent)


@pytest.mark.parametrize("seed", [0])
def test_every_body_gets_a_success_or_an_openai_shaped_4xx_and_the_server_serves_on(tiny_engine, tmp_path, seed):
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    with live_server(tiny_engine, tmp_path) as (srv, url):
        for _ in range(120):
            path, request, sent = fuzz_call(rng)
            extra = request.pop("headers", {})
            response = httpx.post(url + path, headers={**HEADERS, **extra}, timeout=120, **request)
            check_answer(response, sent)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        for query in ("limit=abc", "limit=-1", "limit=" + "9" * 30, "after=../../etc", "order=%00", "limit=true"):
            response = httpx.get(f"{url}/v1/videos?{query}", headers=HEADERS)
            check_answer(response, {query.partition("=")[0]})
        assert statuses.get(200, 0) >= 10, statuses  # real work ran alongside the refusals
        assert httpx.get(url + "/health").status_code == 200
        video = client(url).videos.create_and_poll(prompt="after the fuzz", size="16x16", poll_interval_ms=20,
                                                   extra_body={"num_frames": 1, "num_inference_steps": 1})  # fmt: skip
        assert video.status == "completed"
        wait_for(lambda: srv.served.in_flight == 0, timeout_s=120, what="every accepted request to end")
        assert srv.served.admission.reserved_bytes == 0
