"""Decode one tiny-wan video in this (fresh) process and print, as JSON, how far its resident memory
grew at the peak: fvgraph's whole request (one denoise step, no CFG, so the decode dominates) or
diffusers' own `vae.decode` of latents of the same shape, each tiled or not. Used by
tests/test_vae_tiling.py and perf/bench_memory.py:

    python tests/decode_peak_worker.py fvgraph|diffusers FRAMESxHEIGHTxWIDTH [TILING_JSON]
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def peak_growth(run) -> tuple[int, float, object]:
    """(peak resident growth in bytes, seconds, what `run()` returned), sampling every 2 ms."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], resident_bytes())

    before = resident_bytes()
    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    try:
        out = run()
    finally:
        seconds = time.perf_counter() - began
        stop.set()
        sampler.join()
    return max(peak[0], resident_bytes()) - before, seconds, out


def fvgraph_decode(shape: tuple[int, int, int], tiling: dict | None) -> dict:
    from fvgraph.engine.engine import Engine
    from fvgraph.request import Request
    from fvgraph.serving.memory_reservation import MemoryModel

    frames, height, width = shape
    engine = Engine.from_card("tiny-wan", device="cpu", vae_tiling=tiling)
    # A small request first: lazy initialisation (thread pools, kernels' first use) is not the request's.
    engine.generate([Request(prompt="warm", num_inference_steps=1, height=16, width=16, num_frames=1, seed=1)])
    request = Request(prompt="a fox in the snow", num_inference_steps=1, guidance_scale=1.0, seed=2,
                      height=height, width=width, num_frames=frames)  # fmt: skip
    estimate = MemoryModel(engine).estimate(engine.loop.check_request(request))
    growth, seconds, [result] = peak_growth(lambda: engine.generate([request]))
    return {"ok": result.ok, "error": result.error, "growth": growth, "seconds": seconds, "estimate": estimate.total,
            "parts": estimate.parts}  # fmt: skip


def diffusers_decode(shape: tuple[int, int, int], tiling: dict | None) -> dict:
    from fvgraph.cards import get_card
    from fvgraph.models.components import load_components

    frames, height, width = shape
    vae = load_components(get_card("tiny-wan"), None, torch.device("cpu")).vae
    with torch.no_grad():
        vae.decode(torch.randn(1, vae.config.z_dim, 1, 2, 2))  # the same warm start as fvgraph's
        if tiling is not None:
            vae.enable_tiling(**tiling)
        z = torch.randn(1, vae.config.z_dim, (frames - 1) // 4 + 1, height // 8, width // 8)
        growth, seconds, _ = peak_growth(lambda: vae.decode(z).sample)
    return {"ok": True, "error": None, "growth": growth, "seconds": seconds}


def main(side: str, shape: str, tiling: str | None) -> None:
    dims = tuple(map(int, shape.split("x")))
    options = None if tiling is None else json.loads(tiling)
    run = {"fvgraph": fvgraph_decode, "diffusers": diffusers_decode}[side]
    print(json.dumps({"side": side, "shape": shape, "tiling": options, **run(dims, options)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
