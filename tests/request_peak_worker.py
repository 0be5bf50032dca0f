"""Run one tiny-wan request in this (fresh) process and print, as JSON, how far its resident memory
grew at the peak next to what admission estimates for it. Used by tests/test_admission.py:

    python tests/request_peak_worker.py FRAMESxHEIGHTxWIDTH GUIDANCE
"""

from __future__ import annotations

import json
import sys
import threading

from fvgraph.request import Request
from fvgraph.engine.engine import Engine
from fvgraph.serving.memory_reservation import MemoryModel


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def main(shape: str, guidance: float) -> None:
    frames, height, width = map(int, shape.split("x"))
    engine = Engine.from_card("tiny-wan", device="cpu")
    # A small request first: lazy initialisation (thread pools, kernels' first use) is not the request's.
    engine.generate([Request(prompt="warm", num_inference_steps=1, height=16, width=16, num_frames=1, seed=1)])
    request = Request(prompt="a fox in the snow", num_inference_steps=2, guidance_scale=guidance, seed=2,
                      height=height, width=width, num_frames=frames)  # fmt: skip
    estimate = MemoryModel(engine).estimate(engine.loop.check_request(request))
    peak, stop = [0], threading.Event()

    def sample() -> None:  # every 2 ms: RSS peaks of the VAE decode last hundreds of ms here
        while not stop.wait(0.002):
            peak[0] = max(peak[0], resident_bytes())

    before = resident_bytes()
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        [result] = engine.generate([request])
    finally:
        stop.set()
        sampler.join()
    peak[0] = max(peak[0], resident_bytes())
    print(json.dumps({"ok": result.ok, "error": result.error, "growth": peak[0] - before,
                      "estimate": estimate.total, "parts": estimate.parts}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
