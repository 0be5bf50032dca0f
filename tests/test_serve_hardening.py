"""`fvgraph serve` under hostile input: one answer line per input line, nothing lost, nothing overwritten."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fvgraph.cli import app
from fvgraph.serving.jsonl_server import JsonlServer
from fvgraph.request import Request

TINY = {"prompt": "a fox", "num_inference_steps": 1, "height": 16, "width": 16, "num_frames": 1, "output_type": "latent"}


def request_line(request_id: str, **changes) -> str:
    return json.dumps({**TINY, "request_id": request_id, **changes})


def serve(engine, lines, tmp_path, **options):
    emitted = []
    counts = JsonlServer(engine, tmp_path, emitted.append, **options).serve(lines)
    return emitted, counts


def by_line(emitted) -> dict[int, dict]:
    numbers = [line["line"] for line in emitted]
    assert len(numbers) == len(set(numbers)), f"an input line got two answers: {numbers}"
    return {line["line"]: line for line in emitted}


def test_a_line_that_breaks_the_json_parser_is_rejected_alone(tiny_engine, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000  # RecursionError inside json
    long_int = '{"prompt": "x", "seed": 1' + "0" * 5000 + "}"  # ValueError: int conversion limit
    emitted, counts = serve(tiny_engine, [deep, long_int, request_line("ok1")], tmp_path)
    answers = by_line(emitted)
    assert [answers[n]["status"] for n in (1, 2, 3)] == ["rejected", "rejected", "ok"]
    assert "line 1: not JSON" in answers[1]["error"] and "line 2: not JSON" in answers[2]["error"]
    assert counts == {"ok": 1, "rejected": 2}


def test_invalid_utf8_in_one_line_rejects_that_line_only(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(request_line("a").encode() + b"\n\xff\xfe{}\n" + request_line("b").encode() + b"\n")
    result = CliRunner().invoke(app, ["serve", "-O0", "--requests", str(requests), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(line["line"], line["status"]) for line in lines if line["status"] == "rejected"] == [(2, "rejected")]
    assert {line["request_id"] for line in lines if line["status"] == "ok"} == {"a", "b"}
    assert "UTF-8" in next(line["error"] for line in lines if line["line"] == 2)


def test_input_that_fails_mid_read_keeps_what_was_read(tiny_engine, tmp_path, caplog):
    def lines():
        yield request_line("before")
        raise OSError("the disk went away")

    with caplog.at_level(logging.ERROR, "fvgraph.serving.jsonl_server"):
        emitted, counts = serve(tiny_engine, lines(), tmp_path)
    assert counts == {"ok": 1} and emitted[0]["request_id"] == "before"
    assert "reading the requests failed after line 1" in caplog.text and "disk went away" in caplog.text


def test_an_id_used_earlier_in_the_run_is_refused_and_the_first_output_is_kept(tiny_engine, tmp_path):
    """The second line arrives after the first request came back, so the engine would take it."""
    first_done = threading.Event()
    emitted = []

    def lines():
        yield request_line("same", seed=1)
        assert first_done.wait(timeout=60)
        yield request_line("same", seed=2)

    def emit(line):
        emitted.append(line)
        first_done.set()

    JsonlServer(tiny_engine, tmp_path, emit).serve(lines())
    first, second = by_line(emitted)[1], by_line(emitted)[2]
    assert first["status"] == "ok" and first["request_id"] == "same"
    assert second["status"] == "rejected" and second["request_id"] is None  # one line per id for id-matching clients
    assert "'same' was already used" in second["error"]
    expected = tiny_engine.generate([Request.model_validate(json.loads(request_line("x", seed=1)))])[0].latents
    assert torch.equal(load_file(first["output"])["latents"], expected)


def test_duplicates_and_malformed_control_lines_are_told_apart_from_results(tiny_engine, tmp_path):
    lines = [request_line("fox", num_inference_steps=3), request_line("FOX"), json.dumps({"cancel": "fox", "why": 1}),
             json.dumps({"cancel": "nobody"})]  # fmt: skip
    emitted, counts = serve(tiny_engine, lines, tmp_path)
    answers = by_line(emitted)
    assert [line for line in emitted if line["request_id"] == "fox"] == [answers[1]] and answers[1]["status"] == "ok"
    assert answers[2]["status"] == "rejected" and answers[2]["kind"] == "request" and "already" in answers[2]["error"]
    assert answers[3]["kind"] == "cancel" and answers[3]["status"] == "rejected" and answers[3]["request_id"] is None
    assert answers[4] == {"line": 4, "kind": "cancel", "cancel": "nobody", "request_id": None, "status": "not_in_flight",
                          "error": None}  # fmt: skip
    assert counts == {"ok": 1, "rejected": 1, "cancel rejected": 1, "cancel not_in_flight": 1}


def test_a_cancel_line_does_not_wait_behind_requests_held_back(tiny_engine, tmp_path):
    lines = [request_line("long", num_inference_steps=30), request_line("queued"), request_line("next"),
             json.dumps({"cancel": "long"}), json.dumps({"cancel": "queued"})]  # fmt: skip
    emitted, _ = serve(tiny_engine, lines, tmp_path, max_in_flight=1)
    answers = by_line(emitted)
    assert answers[1]["status"] == "cancelled" and answers[2]["status"] == "cancelled"  # in flight / held back
    assert answers[2]["output"] is None and not (tmp_path / "queued.safetensors").exists()
    assert answers[3]["status"] == "ok"
    assert answers[4]["status"] == answers[5]["status"] == "accepted"


def test_a_huge_request_id_is_never_echoed_in_full(tiny_engine, tmp_path, caplog):
    huge = "a" * 2_000_000
    lines = [request_line(huge), json.dumps({"cancel": huge}), json.dumps({"prompt": "x", "request_id": huge, "bad": 1})]
    with caplog.at_level(logging.WARNING):
        emitted, _ = serve(tiny_engine, lines, tmp_path)
    assert len(emitted) == 3 and all(len(json.dumps(line)) < 2000 for line in emitted)
    assert all(len(record.getMessage()) < 2000 for record in caplog.records)
    with pytest.raises(ValueError, match="request_id"):
        Request(prompt="x", request_id="b" * 129)
    with pytest.raises(ValueError, match="request_id"):
        Request(prompt="x", request_id="two\nlines")


@pytest.mark.parametrize(("args", "message"), [(["--fps", "0"], "fps=0"), (["--fps", "-3"], "fps=-3"),
                                               (["--format", "avi"], "avi"), (["-o", "a-file/out"], "--output-dir")])
def test_serve_checks_output_options_before_any_work(tmp_path, monkeypatch, args, message):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "r.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fvgraph.engine.engine.Engine.from_card", lambda *a, **k: pytest.fail("the engine was built"))
    result = CliRunner().invoke(app, ["serve", "-O0", *args, "--requests", "r.jsonl"])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize(("args", "message"), [(["--fps", "0"], "fps=0"), (["-o", "video.avi"], ".gif or .mp4"),
                                               (["-o", "a-file/video.gif"], "--output: cannot write")])
def test_generate_checks_output_options_before_any_work(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setattr("fvgraph.engine.engine.Engine.from_card", lambda *a, **k: pytest.fail("the engine was built"))
    result = CliRunner().invoke(app, ["generate", "--steps", "1", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_mp4_needs_pyav_and_says_so_at_start_up(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # as on an install without PyAV
    monkeypatch.setattr("fvgraph.engine.engine.Engine.from_card", lambda *a, **k: pytest.fail("the engine was built"))
    result = CliRunner().invoke(app, ["serve", "-O0", "--format", "mp4", "--requests", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 2 and "PyAV" in result.output, result.output


def test_mp4_is_written_with_pyav(tmp_path):
    import av
    import numpy as np

    from fvgraph.serving.media_encode import encode_mp4
    from fvgraph.media_file import write_video

    frames = np.random.default_rng(0).integers(0, 255, size=(5, 32, 48, 3), dtype=np.uint8)
    path = write_video(frames, tmp_path / "v.mp4", fps=8)
    with av.open(str(path)) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(decoded) == 5 and decoded[0].shape == (32, 48, 3)
    # one encoder: the file the CLI and the JSON-lines server write is the bytes the HTTP server sends
    assert path.read_bytes() == encode_mp4(frames, 8)


def test_a_reader_that_closes_stdout_does_not_lose_the_remaining_requests(tmp_path):
    """`fvgraph serve | head -1`: the results cannot be printed any more, the videos are still written."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join([request_line("first"), request_line("second", num_inference_steps=15),
                                   request_line("third", num_inference_steps=15)]) + "\n")  # fmt: skip
    out = tmp_path / "out"
    serving = subprocess.Popen([sys.executable, "-m", "fvgraph", "serve", "-O0", "--device", "cpu", "--requests",
                                str(requests), "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    first = json.loads(serving.stdout.readline())
    serving.stdout.close()  # what `head -1` does after its line
    _, err = serving.communicate(timeout=300)
    assert first["request_id"] == "first"
    assert serving.returncode == 0, err.decode()[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["first.safetensors", "second.safetensors", "third.safetensors"]
    assert "3 ok" in err.decode()


@pytest.mark.parametrize(("cache", "named"), [
    (["magcache"], "cache.method=['magcache'] is not a known method"),
    ({"name": "magcache"}, "cache.method={'name': 'magcache'} is not a known method"),
])  # fmt: skip
def test_a_cache_method_that_is_not_a_name_is_rejected_naming_the_field(tiny_engine, tmp_path, cache, named):
    answers = []
    lines = [json.dumps({"prompt": "x", "num_inference_steps": 1, "cache": {"method": cache}}),
             json.dumps({"prompt": "x", "num_inference_steps": 1, "request_id": "fine", "height": 16, "width": 16,
                         "num_frames": 1, "output_type": "latent"})]  # fmt: skip
    JsonlServer(tiny_engine, tmp_path, answers.append).serve(lines)
    bad, fine = sorted(answers, key=lambda a: a["line"])
    assert bad["status"] == "rejected" and named in bad["error"] and "could not be read" not in bad["error"], bad
    assert fine["status"] == "ok", fine


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "0", "--memory-budget", "inf"], "--memory-budget='inf' must be a finite size"),
    (["--port", "0", "--memory-budget", "1e400GiB"], "--memory-budget='1e400GiB' must be a finite size"),
    (["--port", "0", "--memory-budget", "nan"], "--memory-budget='nan' must be positive"),
    (["--port", "0", "--max-body-bytes", "0"], "--max-body-bytes=0 must be at least 1"),
    (["--cfg-parallel", "0"], "--cfg-parallel=0 must be 1 or 2"),
    (["--ulysses", "0"], "--ulysses=0 must be at least 1"),
    (["--ulysses", "-2", "--cfg-parallel", "2"], "--ulysses=-2 must be at least 1"),
])  # fmt: skip
def test_serve_refuses_bad_limits_and_degrees_naming_the_option(tmp_path, monkeypatch, args, message):
    (tmp_path / "r.jsonl").write_text("")
    monkeypatch.setattr("fvgraph.engine.engine.Engine.from_card", lambda *a, **k: pytest.fail("the engine was built"))
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["serve", "-O0", "-o", str(tmp_path), *args,
                                                            "--requests", str(tmp_path / "r.jsonl")])  # fmt: skip
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(("args", "message"), [(["--cfg-parallel", "0"], "--cfg-parallel=0 must be 1 or 2"),
                                               (["--ulysses", "0"], "--ulysses=0 must be at least 1")])
def test_generate_refuses_parallel_degrees_below_one(tmp_path, monkeypatch, args, message):
    monkeypatch.setattr("fvgraph.engine.engine.Engine.from_card", lambda *a, **k: pytest.fail("the engine was built"))
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["generate", "--steps", "1", "-o", str(tmp_path / "v.gif"), *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
