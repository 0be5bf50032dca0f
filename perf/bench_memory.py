"""The memory plane's costs and savings: peak memory and seconds per request for tiled decode, each
offload mode, and sleep / wake.

    python perf/bench_memory.py                  # tiny-wan on the CPU, 5x256x256, 3 rounds
    python perf/bench_memory.py --repeats 5 --shape 9x256x256
    python perf/bench_memory.py --gpu            # Wan 2.2 A14B's config (seeded, bf16), 720x1280x81, 80 GB of the GPU
    python perf/bench_memory.py --gpu --device cpu --card tiny-wan2.2-a14b --shape 48x64x5 --blocks 1   # rehearsed on the CPU

CPU: every sample is a fresh process (fvgraph/perf/memory_worker.py) serving one decode-heavy request
(one denoise step, no CFG), its peak resident growth read from the kernel's high-water mark; the
cases run interleaved, the order rotated each round. Cases: fvgraph's whole and tiled decode beside
diffusers' own `vae.decode` untiled and after `enable_tiling(**same)`; the request with each offload
mode; sleep at levels 1 and 2 on wan-cpu-bench (resident memory before and after, and the seconds sleep
and wake take).
Prints one JSON line: per case growth in MiB and seconds as min / median / max, and the paired ratios
tiled / whole.

GPU (`--gpu`): one process; the Wan 2.2 T2V A14B transformer config twice (two experts, seeded bf16,
28 GB each), a one-layer text encoder of UMT5's width and the released VAE config, under
`torch.cuda.set_per_process_memory_fraction` set to 80 GB, as on an 80 GB card. Cases: everything
resident, one expert resident with tiled decode (`offload="components"`, `vae_tiling=True`), and both
experts' blocks streamed four at a time with tiled decode (`offload="blocks:4"`).
Each: the allocated memory once the engine is built and the most allocated while it was built (with
offload, what stays in host memory is loaded there and never placed on the device whole:
fvgraph/models/placement.py), the request's peak, its seconds per denoise step and for the decode, or
the out-of-memory error where it does not fit. `--device cpu` runs the same cases' code on the CPU
(with `--card` and `--shape` sized for it), with zeros for memory: a rehearsal of the script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from fvgraph.perf.method import emit, paired_ratio, provenance, spread

TILES = {"tile_sample_min_height": 128, "tile_sample_min_width": 128, "tile_sample_stride_height": 96,
         "tile_sample_stride_width": 96}  # fmt: skip
MIB = 2**20


def cpu_cases(tiles: dict) -> dict[str, list[str]]:
    """Case name -> the worker's arguments after CARD and SHAPE."""
    return {
        "fvgraph_whole": ["fvgraph"], "fvgraph_tiled": ["fvgraph", json.dumps({"vae_tiling": tiles})],
        "diffusers_whole": ["diffusers"], "diffusers_tiled": ["diffusers", json.dumps(tiles)],
        "offload_components": ["fvgraph", json.dumps({"offload": "components"})],
        "offload_blocks_1": ["fvgraph", json.dumps({"offload": "blocks:1"})],
        "sleep_level_1": ["sleep", "1"], "sleep_level_2": ["sleep", "2"],
    }  # fmt: skip


# Sleep is measured where the transformer's bytes stand out of the noise: wan-cpu-bench's is 54 MB
# (tiny-wan's 0.2 MB would vanish in the allocator's movements).
SLEEP_CARD, SLEEP_SHAPE = "wan-cpu-bench", "5x64x64"


def _worker(card: str, shape: str, side: str, *extra: str) -> dict:
    args = [sys.executable, "-m", "fvgraph.perf.memory_worker", side, card, shape, *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[2:])} failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["ok"]:
        raise RuntimeError(f"{' '.join(args[2:])}: {out['error']}")
    return out


def run_cpu(card: str, shape: str, repeats: int, only: list[str] | None = None) -> dict:
    cases = {name: args for name, args in cpu_cases(TILES).items() if only is None or name in only}
    samples: dict[str, list[dict]] = {name: [] for name in cases}
    for r in range(repeats):
        names = list(cases)
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            on = (SLEEP_CARD, SLEEP_SHAPE) if name.startswith("sleep") else (card, shape)
            samples[name].append(_worker(*on, cases[name][0], *cases[name][1:]))
    out: dict = {}
    for name, runs in samples.items():
        if name.startswith("sleep"):
            out[name] = {"transformer_mib": round(runs[0]["transformer_bytes"] / MIB, 2),
                         "dropped_mib": spread([(s["awake"] - s["asleep"]) / MIB for s in runs]),
                         "after_wake_mib": spread([(s["woken"] - s["awake"]) / MIB for s in runs]),
                         "sleep_s": spread([s["sleep_seconds"] for s in runs]),
                         "wake_s": spread([s["wake_seconds"] for s in runs])}  # fmt: skip
        else:
            out[name] = {"growth_mib": spread([s["growth"] / MIB for s in runs]), "seconds": spread([s["seconds"] for s in runs])}
    for side in ("fvgraph", "diffusers"):
        if f"{side}_whole" not in samples or f"{side}_tiled" not in samples:
            continue
        whole, tiled = samples[f"{side}_whole"], samples[f"{side}_tiled"]
        out[f"{side}_tiled_over_whole_growth"] = paired_ratio([s["growth"] for s in tiled], [s["growth"] for s in whole])
    return out


def a14b_bench_card():
    """Wan 2.2 T2V A14B's shapes with seeded weights: what the 80 GB case runs without a checkpoint.
    Its boundary sits where two steps straddle it, so both experts run (step time depends on shapes only)."""
    from fvgraph.card import ModelCard
    from fvgraph.cards import get_card
    from fvgraph.cards.wan import WAN_1_3B_TRANSFORMER

    released = get_card("wan2.2-t2v-a14b")
    dit = {**WAN_1_3B_TRANSFORMER, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
    te = {**get_card("wan2.1-1.3b-bench").components["text_encoder"].config}
    components = {name: spec.model_copy(update={"config": {"transformer": dit, "transformer_2": dit, "text_encoder": te,
                                                           "vae": {}, "tokenizer": {"model_max_length": 512}}[name]})
                  for name, spec in released.components.items()}  # fmt: skip
    recipe = released.recipe.model_copy(update={"boundary_ratio": 0.99})
    return ModelCard.model_validate({**released.model_dump(), "card_id": "wan2.2-a14b-bench", "hub_repos": (),
                                     "components": {k: v.model_dump() for k, v in components.items()},
                                     "recipe": recipe.model_dump(), "seed": 0})  # fmt: skip


def measure_case(card, device: torch.device, options: dict, shape: tuple[int, int, int], steps: int) -> dict:
    """One request on a fresh engine: memory after loading, the peak, seconds per denoise step and for
    the decode (CUDA: allocated bytes; the CPU rehearses the same code with zeros for memory)."""
    from fvgraph.engine.engine import Engine
    from fvgraph.request import Request

    cuda = device.type == "cuda"
    allocated = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
    peak = (lambda: torch.cuda.max_memory_allocated(device)) if cuda else (lambda: 0)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    height, width, frames = shape
    engine = Engine.from_card(card, device=device, opt_level=0, **options)
    loaded, build_peak = allocated(), peak()
    state = engine.start(Request(prompt="a fox in the snow", num_inference_steps=steps, height=height, width=width,
                                 num_frames=frames, guidance_scale=4.0, seed=0))  # fmt: skip
    step_s, decode_s = [], 0.0
    while state.phase != "done":
        phase = state.phase
        sync()
        began = time.perf_counter()
        engine.step(state)
        sync()
        if phase == "denoise":
            step_s.append(time.perf_counter() - began)
        elif phase == "decode":
            decode_s += time.perf_counter() - began
    return {"ok": True, "loaded_gb": round(loaded / 1e9, 2), "build_peak_gb": round(build_peak / 1e9, 2),
            "peak_gb": round(peak() / 1e9, 2), "step_s": spread(step_s), "decode_s": round(decode_s, 3)}  # fmt: skip


GPU_CASES = {"everything_resident": {}, "one_expert_tiled": {"offload": "components", "vae_tiling": True},
             "blocks_tiled": {"offload": "blocks:4", "vae_tiling": True}}  # fmt: skip


def gpu_case_options(name: str, blocks: int) -> dict:
    """The engine options of a GPU case; `blocks`: blocks per group of the block offload case."""
    options = GPU_CASES[name]
    return {**options, "offload": f"blocks:{blocks}"} if name == "blocks_tiled" else options


def run_gpu(shape: tuple[int, int, int], steps: int, budget_gb: float, cases: list[str], device: torch.device,
            card_id: str | None, blocks: int = 4) -> dict:  # fmt: skip
    """The GPU cases on `device` (a CPU rehearses their code: no memory cap, zeros for memory)."""
    from fvgraph.cards import get_card

    card = a14b_bench_card() if card_id is None else get_card(card_id)
    out: dict = {"card": card.card_id, "device": str(device)}
    cuda = device.type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gb * 1e9 / total), device)
        out.update(budget_gb=budget_gb, device_total_gb=round(total / 1e9, 1))
    for name in cases:
        options = gpu_case_options(name, blocks)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            out[name] = measure_case(card, device, options, shape, steps)
        except torch.OutOfMemoryError as err:  # what "does not fit an 80 GB card" looks like
            out[name] = {"ok": False, "peak_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2), "error": str(err)[:300]}
        if cuda:
            torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--card", help="the card (default: tiny-wan on the CPU; with --gpu, Wan 2.2 A14B's config)")
    parser.add_argument("--device", default="cuda", help="--gpu: the device; cpu rehearses the GPU cases' code")
    parser.add_argument("--shape", help="FxHxW on the CPU (default 5x256x256); HxWxF with --gpu (default 720x1280x81)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="--gpu: denoise steps (the bench card's boundary is crossed at 2)")
    parser.add_argument("--budget-gb", type=float, default=80.0, help="--gpu: the memory the process may use")
    parser.add_argument("--blocks", type=int, default=4, help="--gpu: blocks per group of the blocks_tiled case")
    parser.add_argument("--case", action="append", help="run only these cases (repeatable; default: all of the mode's)")
    args = parser.parse_args()
    known = list(GPU_CASES) if args.gpu else list(cpu_cases(TILES))
    unknown = sorted(set(args.case or ()) - set(known))
    if unknown:
        parser.error(f"--case {', '.join(unknown)}: the cases are {', '.join(known)}")
    if args.gpu:
        shape = tuple(int(v) for v in (args.shape or "720x1280x81").split("x"))
        device = torch.device(args.device)
        emit({**provenance("memory", device), "shape": shape,
              **run_gpu(shape, args.steps, args.budget_gb, args.case or list(GPU_CASES), device, args.card, args.blocks)})  # fmt: skip
    else:
        shape, card = args.shape or "5x256x256", args.card or "tiny-wan"
        emit({**provenance("memory", torch.device("cpu")), "card": card, "shape": shape, "tiles": TILES,
              **run_cpu(card, shape, args.repeats, args.case)})  # fmt: skip


if __name__ == "__main__":
    main()
