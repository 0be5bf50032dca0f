"""Time to the first streamed frame against time to the whole file, over HTTP, on tiny-wan.

    python perf/bench_stream.py --repeats 5 --frames 33 --size 64 --steps 8

An in-process `fvgraph serve` (HttpServer on 127.0.0.1). Two cases, timed interleaved (perf/method.py):
`streamed` creates a video and at once reads `GET /v1/videos/{id}/content?stream=true` to its end,
then waits for the video's final event and downloads the stored file; `file_only` does the same without
the streamed read. From the POST:
- `first_frame_s`: until the streamed bytes received so far first decode (PyAV, afterwards, on the
  prefixes as they arrived) to at least one frame;
- `stream_end_s`: until the stream's last byte;
- `file_s`: until the stored mp4 is downloaded (both cases).
Prints one JSON line: provenance, the settings, each figure's spread, and first_frame / file per round.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import av

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf.method import Case, interleaved, paired_ratio, provenance, spread  # noqa: E402

try:  # the HTTP client openai itself uses: httpx2 in its 3.x releases, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx


def _decodes(data: bytes) -> bool:
    try:
        with av.open(io.BytesIO(data)) as container:
            return next(iter(container.decode(video=0)), None) is not None
    except Exception:  # a prefix without a whole frame yet
        return False


class Runs:
    """One video per call, timed from its POST; keeps the figures of the last call."""

    def __init__(self, url: str, body: dict):
        self.url, self.body = url, body
        self.figures: dict[str, list[float]] = {"first_frame_s": [], "stream_end_s": [], "streamed_file_s": [], "file_only_file_s": []}

    def _create(self) -> tuple[str, float]:
        began = time.perf_counter()
        response = httpx.post(f"{self.url}/v1/videos", json=self.body, timeout=60)
        response.raise_for_status()
        return response.json()["id"], began

    def _file(self, video_id: str, began: float) -> float:
        with httpx.stream("GET", f"{self.url}/v1/videos/{video_id}/events", timeout=300) as events:
            for line in events.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:]).get("status") in ("completed", "failed"):
                    break
        response = httpx.get(f"{self.url}/v1/videos/{video_id}/content", timeout=60)
        response.raise_for_status()
        return time.perf_counter() - began

    def streamed(self) -> None:
        video_id, began = self._create()
        arrivals: list[tuple[float, bytes]] = []
        with httpx.stream("GET", f"{self.url}/v1/videos/{video_id}/content?stream=true", timeout=300) as response:
            for piece in response.iter_bytes():
                arrivals.append((time.perf_counter() - began, piece))
        self.figures["streamed_file_s"].append(self._file(video_id, began))
        self.figures["stream_end_s"].append(arrivals[-1][0])
        received = b""
        for at, piece in arrivals:
            received += piece
            if _decodes(received):
                self.figures["first_frame_s"].append(at)
                return
        raise RuntimeError("the stream never decoded to a frame")

    def file_only(self) -> None:
        video_id, began = self._create()
        self.figures["file_only_file_s"].append(self._file(video_id, began))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fps", type=int, default=16)
    args = parser.parse_args()

    import torch

    from fvgraph import Engine
    from fvgraph.serving.http_app import HttpSettings
    from fvgraph.serving.http_server import HttpServer

    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=0)
    body = {"prompt": "a fox in the snow", "size": f"{args.size}x{args.size}", "num_frames": args.frames, "fps": args.fps,
            "num_inference_steps": args.steps, "seed": 0}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fvgraph-bench-stream-") as folder:
        server = HttpServer(engine, HttpSettings(playground=False), Path(folder), port=0)
        with server.running() as url:
            runs = Runs(url, body)
            cases = [Case("streamed", runs.streamed), Case("file_only", runs.file_only)]
            interleaved(cases, args.repeats, warmup=1, device=torch.device("cpu"))
    figures = {name: values[1:] for name, values in runs.figures.items()}  # the warmup call's first
    line = {**provenance("stream", torch.device("cpu")), "card": "tiny-wan", "opt_level": 0, **vars(args),
            **{name: spread(values) for name, values in figures.items()},
            "first_frame_over_file": paired_ratio(figures["first_frame_s"], figures["streamed_file_s"])}  # fmt: skip
    print(json.dumps(line))


if __name__ == "__main__":
    main()
