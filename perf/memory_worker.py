"""One request (or one decode) in this fresh process; prints, as JSON, how far resident memory grew at
its peak and how long it took. perf/bench_memory.py runs it once per sample, and so does
tests/test_vae_tiling.py: memory a decode freed stays with the allocator, so a second one in the same
process would grow it less.

    python -m fvgraph.perf.memory_worker fvgraph CARD FxHxW ['{"vae_tiling": {...}, "offload": ...}']
    python -m fvgraph.perf.memory_worker diffusers CARD FxHxW ['{"tile_sample_min_height": ...}' | 'true']
    python -m fvgraph.perf.memory_worker sleep CARD FxHxW LEVEL

`fvgraph` serves one request (one denoise step, no CFG: the decode dominates) on an engine built
with the given Engine.from_card keywords; `diffusers` decodes latents of the same shape with
diffusers' own VAE (tiled with enable_tiling's keywords, or untiled); `sleep` builds the engine,
serves a request, then reports resident memory after `engine.sleep(LEVEL)` and after `engine.wake()`.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _high_water_bytes() -> int:
    """The kernel's peak resident size of this process since the last reset (VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_growth(run) -> tuple[int, float, object]:
    """(peak resident growth in bytes, seconds, what `run()` returned). The peak is the kernel's
    high-water mark, reset first (Linux: writing 5 to /proc/self/clear_refs), so no short peak is missed."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = resident_bytes()
    began = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - began
    return _high_water_bytes() - before, seconds, out


def _engine(card: str, options: dict):
    from fvgraph.engine.engine import Engine
    from fvgraph.request import Request

    engine = Engine.from_card(card, device="cpu", **options)
    # A small request first: lazy initialisation (thread pools, kernels' first use) is not the request's.
    engine.generate([Request(prompt="warm", num_inference_steps=1, height=16, width=16, num_frames=1, seed=1)])
    return engine


def _request(shape: tuple[int, int, int]):
    from fvgraph.request import Request

    frames, height, width = shape
    return Request(prompt="a fox in the snow", num_inference_steps=1, guidance_scale=1.0, seed=2, height=height,
                   width=width, num_frames=frames)  # fmt: skip


def fvgraph_request(card: str, shape: tuple[int, int, int], options: dict) -> dict:
    from fvgraph.serving.memory_reservation import MemoryModel

    engine = _engine(card, options)
    request = _request(shape)
    estimate = MemoryModel(engine).estimate(engine.loop.check_request(request))
    growth, seconds, [result] = peak_growth(lambda: engine.generate([request]))
    return {"ok": result.ok, "error": result.error, "growth": growth, "seconds": seconds, "estimate": estimate.total,
            "parts": estimate.parts}  # fmt: skip


def diffusers_decode(card: str, shape: tuple[int, int, int], tiling: dict | bool | None) -> dict:
    from fvgraph.cards import get_card
    from fvgraph.models.components import load_components

    frames, height, width = shape
    c = load_components(get_card(card), None, torch.device("cpu"))
    vae, spatial, temporal = c.vae, c.facts.vae_spatial, c.facts.vae_temporal
    with torch.no_grad():
        vae.decode(torch.randn(1, vae.config.z_dim, 1, 2, 2))  # a warm start like fvgraph's
        if tiling is not None:
            vae.enable_tiling(**({} if tiling is True else tiling))
        z = torch.randn(1, vae.config.z_dim, (frames - 1) // temporal + 1, height // spatial, width // spatial)
        growth, seconds, _ = peak_growth(lambda: vae.decode(z).sample)
    return {"ok": True, "error": None, "growth": growth, "seconds": seconds}


def sleep_and_wake(card: str, shape: tuple[int, int, int], level: int) -> dict:
    import gc

    engine = _engine(card, {})
    [result] = engine.generate([_request(shape)])
    gc.collect()
    _trim()  # what the request freed goes back first, so the drop below is the weights'
    awake = resident_bytes()
    began = time.perf_counter()
    engine.sleep(level=level)
    slept, asleep = time.perf_counter() - began, resident_bytes()
    began = time.perf_counter()
    engine.wake()
    woke = time.perf_counter() - began
    transformer = sum(p.numel() * p.element_size() for p in engine.loop.components.transformer.parameters())
    return {"ok": result.ok, "error": result.error, "transformer_bytes": transformer, "awake": awake, "asleep": asleep,
            "woken": resident_bytes(), "sleep_seconds": slept, "wake_seconds": woke}  # fmt: skip


def _trim() -> None:
    """Hand freed heap back to the OS (glibc keeps it otherwise), as a level-2 sleep does."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def main(side: str, card: str, shape: str, extra: str | None) -> None:
    dims = tuple(map(int, shape.split("x")))
    if side == "fvgraph":
        out = fvgraph_request(card, dims, {} if extra is None else json.loads(extra))
    elif side == "diffusers":
        out = diffusers_decode(card, dims, None if extra is None else json.loads(extra))
    elif side == "sleep":
        out = sleep_and_wake(card, dims, int(extra or 1))
    else:
        raise SystemExit(f"side={side!r}: one of fvgraph, diffusers, sleep")
    print(json.dumps({"side": side, "card": card, "shape": shape, "extra": extra, **out}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
