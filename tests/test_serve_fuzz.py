"""Fuzzing `fvgraph serve`'s line handling: whatever the lines hold, each non-blank line gets exactly
one answer, the server finishes, and nothing is written outside the output directory."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fvgraph.serving.jsonl_server import JsonlServer

TINY = {"prompt": "a fox", "num_inference_steps": 1, "height": 16, "width": 16, "num_frames": 1, "output_type": "latent"}
IDS = [f"r{i}" for i in range(30)] + ["../escape", "a/b", ".hidden", "", "x" * 300, "nul\x00id", "line-3"]


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 12 else 4)
    if kind == 0:
        return rng.choice([None, True, False, 0, -1, 2**70, 1e308, -0.0, float("nan")])
    if kind == 1:
        return rng.randrange(-(10**30), 10**30)
    if kind == 2:
        return "".join(chr(rng.randrange(0, 0x2FFF)) for _ in range(rng.randrange(0, 40)))
    if kind == 3:
        return rng.random() * 10 ** rng.randrange(-300, 300)
    if kind < 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    keys = list(TINY) + ["request_id", "cancel", "seed", "guidance_scale", "prompt_embeds", "negative_prompt", "junk"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


def valid_request(rng: random.Random) -> dict:
    request = dict(TINY, seed=rng.randrange(100))
    request["width"] = rng.choice([16, 32])
    request["guidance_scale"] = rng.choice([1.0, 4.0])
    if rng.random() < 0.1:
        request["output_type"] = "np"
    if rng.random() < 0.8:
        request["request_id"] = rng.choice(IDS[:30])
    return request


def broken_request(rng: random.Random) -> dict:
    request = valid_request(rng)
    field = rng.choice([*TINY, "request_id", "seed", "guidance_scale", "colour"])
    request[field] = rng.choice([random_json(rng), True, -5, 4, 20, 1e9, "8", None, rng.choice(IDS)])
    return request


def fuzz_line(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.12:
        return bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randrange(0, 200)))
    if roll < 0.14:
        return rng.choice([b"", b"   ", b"\t\r", "\u2028 \x1c".encode()])
    if roll < 0.17:
        n = rng.choice([50, 5000, 200_000])
        return rng.choice([b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n, b'{"seed": 1' + b"0" * n + b"}"])
    if roll < 0.40:
        return json.dumps(random_json(rng)).encode()
    if roll < 0.65:
        return json.dumps(valid_request(rng)).encode()
    if roll < 0.85:
        return json.dumps(broken_request(rng)).encode()
    if roll < 0.95:
        return json.dumps({"cancel": rng.choice(IDS)}).encode()
    return json.dumps({"cancel": random_json(rng), **({"x": 1} if rng.random() < 0.5 else {})}).encode()


def is_blank(line: bytes) -> bool:
    try:
        return not line.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("seed", [0])
def test_every_line_gets_one_answer_and_outputs_stay_inside_the_output_dir(tiny_engine, tmp_path, seed):
    rng = random.Random(seed)
    lines = [fuzz_line(rng) for _ in range(300)]
    requests = tmp_path / "in" / "requests.jsonl"
    requests.parent.mkdir()
    requests.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    answers = []
    with open(requests, "rb") as source:
        counts = JsonlServer(tiny_engine, out, answers.append, max_in_flight=8).serve(source)

    expected = [n for n, line in enumerate(lines, start=1) if not is_blank(line)]
    assert sorted(a["line"] for a in answers) == expected  # one answer per non-blank line, none for blank ones
    assert sum(counts.values()) == len(answers) and not tiny_engine.has_work()
    assert all(len(json.dumps(a)) < 4000 for a in answers)
    ended = [a["request_id"] for a in answers if a["kind"] == "request" and a["status"] != "rejected"]
    assert len(ended) == len(set(ended)) and counts.get("ok", 0) > 10  # each taken id ends once; real work ran
    for answer in answers:
        if answer.get("output") is not None:
            path = Path(answer["output"]).resolve()
            assert path.parent == out.resolve() and path.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["requests.jsonl"]
