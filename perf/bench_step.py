"""Per-step denoise time, side by side in one run: diffusers eager, diffusers compile_repeated_blocks,
fvgraph -O0 and fvgraph -O1 (inductor, CFG fusion + hoisting), and with --levels also -O2 (CUDA graphs)
and -O3 (FP8), same weights, shapes and inputs.

    python perf/bench_step.py                        # tiny-wan on the CPU
    python perf/bench_step.py --gpu                  # Wan 1.3B config, bf16, 480x832x33 and 256x256x17

A step is the whole CFG step: cond + uncond forward, guidance combine and the UniPC update. The
diffusers variants run the body of WanPipeline's loop (its transformer calls and its scheduler);
fvgraph runs its own step through the engine. Compile time is excluded from step times and reported
apart. Prints one JSON object per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fvgraph.compiler import CompileConfig
from fvgraph.engine import Engine
from fvgraph.perf import sync
from fvgraph.request import Request
from fvgraph.samplers import diffusers_scheduler


def _time_steps(run_one, steps: int, device: torch.device) -> float:
    """Median seconds per step over `steps` calls, after the caller's warmup."""
    times = []
    for _ in range(steps):
        sync(device)
        began = time.perf_counter()
        run_one()
        sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def diffusers_step_runner(transformer, sampler_spec, latents, pe, ne, guidance: float, num_steps: int):
    """The body of WanPipeline.__call__'s denoise loop, restarting the schedule when it runs out."""
    scheduler = diffusers_scheduler(sampler_spec)
    state = {"i": num_steps, "latents": latents.clone()}

    def run_one():
        if state["i"] == num_steps:
            scheduler.set_timesteps(num_steps, device=latents.device)
            state.update(i=0, latents=latents.clone())
        t = scheduler.timesteps[state["i"]]
        x = state["latents"].to(pe.dtype)
        timestep = t.expand(x.shape[0])
        with torch.no_grad():
            cond = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=pe, return_dict=False)[0]
            uncond = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=ne, return_dict=False)[0]
            noise = uncond + guidance * (cond - uncond)
            state["latents"] = scheduler.step(noise, t, state["latents"], return_dict=False)[0]
        state["i"] += 1

    return run_one


def fvgraph_step_runner(engine: Engine, request: Request):
    """Steps one request's denoise loop through the engine, restarting it when it finishes."""
    holder = {}

    def restart():
        holder["state"] = engine.start(request)  # embeds given: the loop starts at its denoise phase

    def run_one():
        state = holder.get("state")
        if state is None or state.phase != "denoise":
            restart()
        engine.step(holder["state"])

    return run_one


def bench_shape(card: str, device: torch.device, height: int, width: int, frames: int, steps: int, warmup: int,
                levels: tuple[int, ...] = (1,)) -> dict:  # fmt: skip
    eager = Engine.from_card(card, device=device)  # fvgraph -O0, with its projection cache
    # diffusers runs on an untouched copy of the same seeded weights (no fvgraph cache in its forward)
    c = Engine.from_card(card, device=device, projection_cache_bytes=0).loop.components
    shapes = eager.card.shapes
    dtype = next(c.transformer.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    pe, ne = (torch.randn(1, shapes.text_len, eager.facts.text_dim, generator=g) for _ in range(2))
    num_steps = max(steps + warmup, 2)
    request = Request(prompt_embeds=pe, negative_prompt_embeds=ne, guidance_scale=5.0, height=height, width=width,
                      num_frames=frames, seed=0, num_inference_steps=num_steps, output_type="latent")  # fmt: skip
    latents = eager.loop.init(request.resolve(eager.card)).latents
    pe_d, ne_d = pe.to(device, dtype), ne.to(device, dtype)
    sampler = eager.card.recipe.sampler

    engines = {level: Engine.from_card(card, device=device, opt_level=level, compile_config=CompileConfig(backend="inductor"))
               for level in sorted({1, *levels})}  # fmt: skip
    compiled = engines[1]
    # seeded cards rebuild bit-identical weights; the version is their content hash
    assert compiled.loop.components.weights_version == c.weights_version == eager.loop.components.weights_version

    runners = {
        "diffusers_eager": diffusers_step_runner(c.transformer, sampler, latents, pe_d, ne_d, 5.0, num_steps),
        "fvgraph_O0": fvgraph_step_runner(eager, request),
        **{f"fvgraph_O{level}": fvgraph_step_runner(engine, request) for level, engine in engines.items()},
    }
    results, compile_s = {}, {}
    for name, run_one in runners.items():
        began = time.perf_counter()
        for _ in range(warmup):
            run_one()
        compile_s[name] = time.perf_counter() - began
        results[name] = _time_steps(run_one, steps, device)

    # compile_repeated_blocks compiles the shared module in place, so it runs last
    began = time.perf_counter()
    c.transformer.compile_repeated_blocks(fullgraph=True)
    regional = diffusers_step_runner(c.transformer, sampler, latents, pe_d, ne_d, 5.0, num_steps)
    for _ in range(warmup):
        regional()
    compile_s["diffusers_compile_repeated_blocks"] = time.perf_counter() - began
    results["diffusers_compile_repeated_blocks"] = _time_steps(regional, steps, device)

    ms = {name: round(seconds * 1e3, 3) for name, seconds in results.items()}
    o1 = results["fvgraph_O1"]
    return {
        "card": card,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {"height": height, "width": width, "frames": frames, "latents": list(latents.shape)},
        "dtype": str(dtype).removeprefix("torch."),
        "steps_timed": steps,
        "per_step_ms": ms,
        "warmup_s_including_compile": {k: round(v, 2) for k, v in compile_s.items()},
        "speedup_O1_vs": {name: round(results[name] / o1, 3) for name in results if name != "fvgraph_O1"},
        "fvgraph_O1_passes": [step.passes_changed for step in compiled.compiler._compiled.values()],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="Wan 1.3B config in bf16 on CUDA")
    parser.add_argument("--shapes", nargs="*", help="HxWxF each (default: 64x64x9 on CPU; 480x832x33 256x256x17 on GPU)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--levels", default="1", help="fvgraph opt levels to time besides -O0, e.g. 1,2,3 (2: CUDA graphs, 3: FP8)")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; run without --gpu for the CPU (tiny-wan) mode")
    device = torch.device("cuda" if args.gpu else "cpu")
    card = "wan2.1-1.3b-bench" if args.gpu else "tiny-wan"
    shapes = args.shapes or (["480x832x33", "256x256x17"] if args.gpu else ["64x64x9"])
    steps = args.steps or (10 if args.gpu else 8)
    for shape in shapes:
        height, width, frames = (int(v) for v in shape.split("x"))
        levels = tuple(int(v) for v in args.levels.split(","))
        print(json.dumps(bench_shape(card, device, height, width, frames, steps, args.warmup, levels)), flush=True)


if __name__ == "__main__":
    main()
