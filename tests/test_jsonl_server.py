"""The JSON-lines server: one result line per request, bad lines rejected by name, late requests join."""

import json
import threading
import time

import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from fvgraph.cli import app
from fvgraph.serving.jsonl_server import JsonlServer
from fvgraph.request import Request

FOX = {"prompt": "a fox", "seed": 1, "request_id": "fox", "num_inference_steps": 2, "num_frames": 5}
SEA = {"prompt": "the sea", "seed": 2, "request_id": "sea", "num_inference_steps": 3, "num_frames": 5, "output_type": "latent"}


def _serve(engine, lines, tmp_path):
    emitted = []
    counts = JsonlServer(engine, tmp_path, emitted.append).serve(lines)
    return {line["request_id"]: line for line in emitted}, emitted, counts


def test_every_line_gets_one_result_and_bad_lines_name_the_rule(tiny_engine, tmp_path):
    lines = [json.dumps(FOX), "", "{not json", json.dumps({"prompt": "x", "num_frames": 4}), json.dumps([1, 2]),
             json.dumps({**SEA, "request_id": "../up"}), json.dumps({**SEA, "colour": "red"}), json.dumps(SEA),
             json.dumps({"cancel": "nobody"})]  # fmt: skip
    by_id, emitted, counts = _serve(tiny_engine, lines, tmp_path)

    assert counts == {"ok": 2, "rejected": 5, "cancel not_in_flight": 1} and len(emitted) == 8
    assert sorted(line["line"] for line in emitted) == [1, 3, 4, 5, 6, 7, 8, 9]  # the blank line 2 needs no answer
    errors = [line["error"] for line in emitted if line["status"] == "rejected"]
    assert errors[0].startswith("line 3: not JSON")
    assert "line 4: num_frames: Value error, num_frames=4 must be 4k+1" in errors[1]
    assert errors[2] == "line 5: line: must be a JSON object, got list"
    assert "line 6: request_id: '../up' must be" in errors[3]
    assert errors[4] == "line 7: colour: Extra inputs are not permitted"
    assert not (tmp_path.parent / "up.safetensors").exists()

    fox, sea = by_id["fox"], by_id["sea"]
    assert fox["status"] == "ok" and fox["seed"] == 1 and fox["timings"]["total"] > 0
    with Image.open(fox["output"]) as gif:
        assert gif.n_frames == 5
    expected = tiny_engine.generate([Request(**SEA)])[0].latents
    assert torch.equal(load_file(sea["output"])["latents"], expected)


def _pace(engine, monkeypatch, second_line: str, after_ticks: int):
    """Lines for the server: the first request at once, `second_line` once `after_ticks` ticks ran.
    The tick after that waits until the second line is queued, so the test does not race the reader."""
    ran, sent = [], threading.Event()
    tick = engine.tick

    def paced_tick(*args):
        if len(ran) == after_ticks:
            assert sent.wait(timeout=60)
        ran.append(True)
        return tick(*args)

    monkeypatch.setattr(engine, "tick", paced_tick)

    def lines(first: str):
        yield first
        deadline = time.monotonic() + 60
        while len(ran) < after_ticks:  # the server must tick while this line is still to come
            assert time.monotonic() < deadline, "the server waited for input instead of running what it had"
            time.sleep(0.001)
        yield second_line
        sent.set()  # the reader asks for the next line only after queueing this one

    return lines


def test_a_request_arriving_mid_run_joins_the_running_ones(tiny_engine, tmp_path, monkeypatch):
    """The late request is short: it ends first only if it ran beside the long one, not after it."""
    late = json.dumps({**SEA, "request_id": "late", "num_inference_steps": 2})
    lines = _pace(tiny_engine, monkeypatch, late, after_ticks=3)
    _, emitted, counts = _serve(tiny_engine, lines(json.dumps({**FOX, "request_id": "long", "num_inference_steps": 8})), tmp_path)
    assert counts == {"ok": 2}
    assert [line["request_id"] for line in emitted] == ["late", "long"]


def test_a_cancel_line_cancels_a_request_in_flight(tiny_engine, tmp_path, monkeypatch):
    lines = _pace(tiny_engine, monkeypatch, json.dumps({"cancel": "fox"}), after_ticks=1)
    by_id, _, counts = _serve(tiny_engine, lines(json.dumps({**FOX, "num_inference_steps": 20})), tmp_path)
    assert counts == {"cancelled": 1, "cancel accepted": 1} and by_id["fox"]["output"] is None


def test_lines_beyond_max_in_flight_wait_until_a_request_comes_back(tiny_engine, tmp_path, monkeypatch):
    before_submit = []
    submit = tiny_engine.submit
    monkeypatch.setattr(tiny_engine, "submit", lambda r: (before_submit.append(tiny_engine.in_flight), submit(r))[1])
    lines = [json.dumps({**SEA, "request_id": f"r{i}", "num_inference_steps": 2}) for i in range(4)]
    emitted = []
    counts = JsonlServer(tiny_engine, tmp_path, emitted.append, max_in_flight=2).serve(lines)
    assert counts == {"ok": 4}
    assert before_submit and max(before_submit) < 2  # never a third request in the engine


def test_serve_command_reads_a_requests_file_and_prints_json_lines(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(SEA) + "\n" + json.dumps({"prompt": "x", "height": 20}) + "\n")
    result = CliRunner().invoke(app, ["serve", "-O0", "--requests", str(requests), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {(line["request_id"], line["status"]) for line in lines} == {("sea", "ok"), (None, "rejected")}
    assert (tmp_path / "out" / "sea.safetensors").is_file()


def test_serve_command_refuses_an_unknown_video_format(tmp_path):
    result = CliRunner().invoke(app, ["serve", "-O0", "--format", "avi", "--requests", str(tmp_path / "none")])
    assert result.exit_code == 2
    assert "video_format='avi' must be 'gif' or 'mp4'" in result.output
