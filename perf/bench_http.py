"""What serving over HTTP costs: one request mix through the in-process engine and through
`fvgraph serve --port` (a separate process on 127.0.0.1), requests/s and p50/p95 latency side by side.

    python perf/bench_http.py                     # tiny-wan on the CPU, -O1 (inductor)
    python perf/bench_http.py --opt-level 0       # quick: eager, nothing compiled
    python perf/bench_http.py --gpu               # CUDA at -O2

Both sides get the same requests (text prompts, mixed seeds, guidance, step counts and shapes), all
at once, and do the same work: the engine through submit / tick with each finished video encoded to
mp4 on a worker thread (as the server does), the server from one client thread per request that
posts the video (JSON) and follows its Server-Sent Events until the final Video object (so latency is
from the POST to a downloadable mp4). What the server adds is HTTP itself: parsing, the hand-over to
the engine thread and the event stream. The compiled steps are made once, in this process, into a
capture cache the server then loads (`--cache-dir --fail-on-recompile`); both stay up for the whole
run.

On the benchmark method (fvgraph.perf.method): `--repeats R` rounds, each running the mix through
both sides, the side that goes first alternating; every figure is the spread over the rounds and
`http_throughput_ratio` (HTTP requests/s over the engine's) is taken per round. Target: at least
0.95. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.serving.media_encode import encode_mp4
from fvgraph.perf.method import emit, paired_ratio, provenance, spread, sync
from fvgraph.request import Request

FPS = 16.0


def request_mix(n: int, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """The request fields both sides use: mixed shapes, seeds, guidance and step counts."""
    return [
        {"prompt": f"request {i}: a red fox running through fresh snow", "num_frames": shapes[i % len(shapes)][0],
         "height": shapes[i % len(shapes)][1], "width": shapes[i % len(shapes)][2], "seed": i,
         "guidance_scale": 3.0 + i % 5, "num_inference_steps": 4 + i % 3 * 2}  # fmt: skip
        for i in range(n)
    ]


def _summary(latencies: list[float], wall: float) -> dict:
    ordered = sorted(latencies)
    return {"requests_per_s": round(len(ordered) / wall, 4), "wall_s": round(wall, 4),
            "p50_s": round(statistics.median(ordered), 4),
            "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4)}  # fmt: skip


def run_engine(engine: Engine, mix: list[dict], device: torch.device, tag: str) -> dict:
    """The mix through submit / tick; each finished video is encoded on a worker thread, as the server does."""
    for fields in mix:
        engine.submit(Request(**fields, request_id=f"engine-{tag}-{fields['seed']}"))
    sync(device)
    began, results, encodes = time.perf_counter(), [], []
    with concurrent.futures.ThreadPoolExecutor(1) as encoder:
        while engine.has_work():
            for result in engine.tick():
                results.append(result)
                encodes.append(encoder.submit(lambda r=result: (encode_mp4(r.frames, FPS), time.perf_counter())[1]))
        done = [future.result() for future in encodes]
    sync(device)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    # latency: submit to encoded mp4, as the HTTP side measures POST to the final event
    latencies = [end - began for end in done]
    return _summary(latencies, max(done) - began)


def _one_http(base: str, fields: dict) -> float:
    """POST the video, follow its events to the final Video object; seconds from the POST."""
    url = urlparse(base)
    began = time.perf_counter()
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    body = {k: v for k, v in fields.items() if k not in ("height", "width")}
    body.update(size=f"{fields['width']}x{fields['height']}", fps=FPS)
    connection.request("POST", "/v1/videos", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    video = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"POST /v1/videos: {response.status} {video}")
    connection.request("GET", f"/v1/videos/{video['id']}/events")
    events, kind = connection.getresponse(), None
    for raw in events:
        line = raw.decode().strip()
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind == "video":
            status = json.loads(line[6:])["status"]
            if status in ("completed", "failed"):
                if status != "completed":
                    raise RuntimeError(f"video {video['id']}: {line}")
                break
    connection.close()
    return time.perf_counter() - began


def start_server(args: argparse.Namespace, cache_dir: Path, out_dir: Path, shapes) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "fvgraph", "serve", "--port", "0", "-O", str(args.opt_level), "--card", args.card,
               "--device", args.device, "--compile-backend", args.compile_backend, "-o", str(out_dir),
               "--max-running", str(args.max_running), "--max-queue", str(len(shapes) + args.requests)]  # fmt: skip
    command += [arg for f, h, w in shapes for arg in ("--warmup-shape", f"{f}x{h}x{w}")]  # warm as the engine side was
    if args.opt_level >= 1:
        command += ["--cache-dir", str(cache_dir), "--fail-on-recompile"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True).start()
    deadline = time.monotonic() + args.startup_timeout
    while not (found := [m[1] for line in lines if (m := re.search(r"on (http://\S+)/v1", line))]):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the server did not start:\n" + "".join(lines))
        time.sleep(0.1)
    base = found[0]
    while True:  # ready once its warmup shapes are loaded from the cache
        connection = http.client.HTTPConnection(urlparse(base).hostname, urlparse(base).port, timeout=10)
        connection.request("GET", "/ready")
        if connection.getresponse().status == 200:
            return server, base
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the server never became ready:\n" + "".join(lines))
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs the mix through both sides")
    parser.add_argument("--shapes", nargs="*", help="FxHxW each (default: 5x32x32 1x32x48 on CPU; 17x256x256 on GPU)")
    parser.add_argument("--opt-level", type=int, default=None, help="default: 1 on CPU, 2 on GPU")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--card", default=None, help="default: tiny-wan on CPU, wan2.1-1.3b-bench on GPU")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; run without --gpu for the CPU (tiny-wan) mode")
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats} must be at least 1")
    args.device = "cuda" if args.gpu else "cpu"
    args.card = args.card or ("wan2.1-1.3b-bench" if args.gpu else "tiny-wan")
    args.opt_level = (2 if args.gpu else 1) if args.opt_level is None else args.opt_level
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or (["17x256x256"] if args.gpu else ["5x32x32", "1x32x48"]))]
    mix = request_mix(args.requests, shapes)
    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="fvgraph-bench-http-"))
    report = {**provenance("bench_http", device), "card": args.card, "opt_level": args.opt_level,
              "requests": args.requests, "shapes": shapes}  # fmt: skip

    engine = Engine.from_card(args.card, opt_level=args.opt_level, device=device, max_running=args.max_running,
                              cache_dir=work / "cache" if args.opt_level >= 1 else None,
                              compile_config=CompileConfig(backend=args.compile_backend))  # fmt: skip
    warm = time.perf_counter()
    first = {(f["num_frames"], f["height"], f["width"]): f for f in reversed(mix)}
    engine.warmup([Request(**{**f, "num_inference_steps": 2}, request_id=f"warm-{i}") for i, f in enumerate(first.values())])
    report["warmup_s"] = round(time.perf_counter() - warm, 2)

    server, base = start_server(args, work / "cache", work / "served", shapes)
    rounds: dict[str, list[dict]] = {"engine": [], "http": []}
    try:
        for r in range(args.repeats):
            sides = ["engine", "http"] if r % 2 == 0 else ["http", "engine"]
            for side in sides:
                if side == "engine":
                    rounds["engine"].append(run_engine(engine, mix, device, tag=str(r)))
                else:
                    began = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(len(mix)) as pool:
                        latencies = list(pool.map(lambda fields: _one_http(base, fields), mix))
                    rounds["http"].append(_summary(latencies, time.perf_counter() - began))
    finally:
        server.send_signal(signal.SIGTERM)
        report["server_exit"] = server.wait(timeout=120)
    for side, runs in rounds.items():
        report[side] = {key: spread([run[key] for run in runs], digits=4) for key in ("requests_per_s", "p50_s", "p95_s")}
    report["http_throughput_ratio"] = paired_ratio([run["requests_per_s"] for run in rounds["http"]],
                                                   [run["requests_per_s"] for run in rounds["engine"]])  # fmt: skip
    report["target_http_throughput_ratio"] = 0.95
    emit(report)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
