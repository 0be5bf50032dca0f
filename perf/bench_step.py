"""Per denoise step, interleaved in one process (fvgraph.perf.method): diffusers eager, diffusers +
compile_repeated_blocks and diffusers + torch.compile (each on its own untouched copy of the weights)
beside fvgraph at each opt level, at batch 1 and at a batch of requests in lockstep.

    python perf/bench_step.py                        # wan-cpu-bench on the CPU, -O0 -O1 -O3, batch 1 and 4
    python perf/bench_step.py --gpu                  # Wan 1.3B config, bf16, 480x832x33 and 256x256x17
    python perf/bench_step.py --card flux-cpu-bench  # FLUX's blocks on the CPU, 192x192 (GPU: --gpu --card flux.1-dev-bench --shapes 1024x1024x1)
    python perf/bench_step.py --card hunyuanvideo-cpu-bench --batch 1  # HunyuanVideo-1.5's blocks, 9x96x160 (GPU: perf/gpu_check.sh's hv15_step)
    python perf/bench_step.py --card flux-kontext-cpu-bench  # FLUX.1 Kontext's step: + a condition image of the output's size

A Wan step is the whole CFG step: cond + uncond forward, guidance combine and the UniPC update; a
FLUX step is FLUX.1-dev's: one forward with the embedded guidance and the Euler update; a FLUX.1
Kontext step is that with the edited image's tokens joined to the sequence (the condition image at
the output's size, `auto_resize=False` as FluxKontextPipeline's `_auto_resize=False`, so the sequence
is twice the output's tokens plus the text; the line's `condition_tokens` says how many); a
HunyuanVideo-1.5 step is its text-to-video CFG step at the card's guidance scale (the texts encoded
untimed: perf/bench_step_hunyuan_video15.py). The
diffusers cases run the body of the family's pipeline loop (perf/diffusers_baselines.py); at batch B they run B requests as one diffusers
batch (same step, same guidance). fvgraph runs B requests through `Engine.submit` / `tick`, one tick
per step, as served: admission and each request's first step (its prologue) are untimed, and no timed
tick finishes a request. Compiles happen in the untimed warmup and are reported apart. Prints one JSON
line per shape: per-step ms per case (min / median / max over the rounds), per-request-step ms at
batch B, and per-round paired speedups with the goals they are held to.
"""

from __future__ import annotations

import argparse
import time

import torch

from fvgraph.contract.flops import flop_counter
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.perf import bench_step_hunyuan_video15 as hunyuan_video15
from fvgraph.models.flux_sections import condition_tokens
from fvgraph.perf.diffusers_baselines import BASELINES, baseline_transformer, diffusers_step_case, flux_step_case, untouched_components
from fvgraph.perf.method import Case, emit, interleaved, paired_ratio, provenance, spread
from fvgraph.request import Request

GUIDANCE = 5.0  # Wan's CFG scale; FLUX.1-dev's embedded guidance is its card's default
# CPU goals: fvgraph -O1 against diffusers + regional compile, 1.5x per CFG step at batch 1 (the issue
# on time lost inside the step: diffusers' efficiency per FLOP on the FLOPs -O1 runs). At batch B the
# goal is read two ways, both reported: against diffusers batching the same B requests (like for
# like), and against diffusers serving them one at a time (its pipeline's serving model).
GOALS = {"O1_vs_compile_repeated_blocks_b1": 1.5, "O1_vs_compile_repeated_blocks_per_request_step_bB": 2.0,
         "O1_bB_per_request_step_vs_compile_repeated_blocks_b1": 2.0}


def fvgraph_case(name: str, engine: Engine, request: Request, batch: int) -> Case:
    """One engine tick per run with `batch` copies of `request` (other seeds) in flight: one batched
    step as served. Untimed: admitting a new batch and its first tick, and draining a finished one."""
    state = {"left": 0, "round": 0}
    steps = request.num_inference_steps

    def before():
        if state["left"] > 0:
            return
        while engine.has_work():  # the last steps and finalize of the previous batch
            for result in engine.tick():
                assert result.ok, result.error
        state["round"] += 1
        for i in range(batch):
            engine.submit(request.model_copy(update={"seed": i, "request_id": f"{name}-{state['round']}-{i}"}))
        for _ in range(1 + len(engine.loop.pre_denoise_phases)):  # admission, an edit's VAE encode, the first step
            engine.tick()  # the per-request prologue runs in the first step
        state["left"] = steps - 2  # the final step (and finalize) stays untimed

    def run():
        done = engine.tick()
        assert not done, [r.error for r in done]
        state["left"] -= 1

    return Case(name, run, before)


GEMM_CALLS = 20  # per timed run: one matmul of these sizes is too short to time alone


def gemm_cases(shapes: list[tuple[int, int, int]], device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Case, int]]:
    """Per (M, K, N): a case of GEMM_CALLS matmuls [M, K] @ [K, N], and its FLOPs per run."""
    cases = {}
    for m, k, n in dict.fromkeys(shapes):
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)

        def run(a=a, b=b):
            for _ in range(GEMM_CALLS):
                torch.mm(a, b)

        name = f"gemm_{m}x{k}x{n}"
        cases[name] = (Case(name, run), 2 * m * k * n * GEMM_CALLS)
    return cases


def step_gemm_shapes(engine: Engine, inputs: dict[str, torch.Tensor], branches: int) -> list[tuple[int, int, int]]:
    """The denoiser's main GEMMs at batch 1: the tokens of every branch by the width, and by the MLP width."""
    step = engine.loop.build_steps()[next(k for k, v in engine.loop.step_kinds.items() if v.per_inference_step)]
    tokens, _, _ = step.attention_shape(inputs)
    config = engine.loop.components.transformer.config
    inner = config.num_attention_heads * config.attention_head_dim
    ffn = config.get("ffn_dim") or 4 * inner
    m = tokens * branches
    return [(m, inner, inner), (m, inner, ffn), (m, ffn, inner)]


def eager_step_flops(case: Case) -> int:
    """FLOPs of one step of an eager diffusers case, counted by torch's flop counter."""
    case.before()
    with flop_counter() as counter:
        case.run()
    return int(counter.get_total_flops())


class Workload:
    """One shape's step on a card: the request fvgraph serves, its batch's initial latents, and the
    same inputs on the device for the diffusers cases (FLUX.1-dev's step: one branch, the guidance an
    input of the denoiser; Wan's: the CFG step at GUIDANCE)."""

    def __init__(self, engine: Engine, device: torch.device, height: int, width: int, frames: int, steps: int, batch: int):
        card, shapes = engine.card, engine.card.shapes
        g = torch.Generator().manual_seed(0)
        pe, ne = (torch.randn(shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(2))
        self.flux, self.hunyuan = card.family == "flux", card.family == hunyuan_video15.FAMILY
        if self.hunyuan:  # it encodes its texts itself: the texts, not embeddings, in the request
            self.guidance = card.recipe.default_guidance_scale
            text = dict(hunyuan_video15.TEXTS, guidance_scale=self.guidance)
        elif self.flux:
            self.guidance = card.recipe.default_guidance_scale
            pooled = torch.randn(engine.loop.components.transformer.config.pooled_projection_dim, generator=g)
            text = dict(prompt_embeds=pe, pooled_prompt_embeds=pooled, guidance_scale=self.guidance)
            if "image" in engine.loop.reads:  # FLUX.1 Kontext: an image of the output's size, encoded at that size
                image = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=g)
                text.update(image=image, auto_resize=False)
        else:
            self.guidance, text = GUIDANCE, dict(prompt_embeds=pe, negative_prompt_embeds=ne, guidance_scale=GUIDANCE)
        self.request = Request(**text, height=height, width=width, num_frames=frames, seed=0, num_inference_steps=steps,
                               output_type="latent")  # fmt: skip
        resolved = self.request.resolve(card, engine.facts)
        self.latents = [engine.loop.init(resolved.model_copy(update={"seed": i})).latents for i in range(batch)]
        self.dtype = engine.loop.components.transformer.dtype
        self.pe, self.ne = pe[None].to(device, self.dtype), ne[None].to(device, self.dtype)
        self.pooled = pooled[None].to(device, self.dtype) if self.flux else None
        family_inputs = hunyuan_video15.attention_inputs(engine.loop.components) if self.hunyuan else {}
        self.text_inputs = {"prompt_embeds": self.pe, **family_inputs}  # what the step's attention_shape reads
        self.engine, self.device, self.steps, self.card_id = engine, device, steps, card.card_id
        self.branches = 1 if self.flux else 2
        self.condition = None if self.request.image is None else edit_condition(engine, self.request)  # an edit's latents

    def diffusers_case(self, name: str, kind: str, batch: int) -> Case:
        """Baseline `kind` on its own untouched copy of the weights (a compiled copy keeps its graph)."""
        version = self.engine.loop.components.weights_version
        components = untouched_components(self.card_id, self.device, version)
        transformer = baseline_transformer(kind, components)
        sampler, latents = self.engine.card.recipe.sampler, torch.cat(self.latents[:batch])
        if self.hunyuan:
            return hunyuan_video15.step_case(name, transformer, components, sampler, latents, self.guidance, self.steps)
        if self.flux:
            return flux_step_case(name, transformer, sampler, latents, self.pe, self.pooled, self.guidance, self.steps,
                                  self.engine.loop.spatial_scale, self.condition)  # fmt: skip
        return diffusers_step_case(name, transformer, sampler, latents, self.pe, self.ne, GUIDANCE, self.steps)


def edit_condition(engine: Engine, request: Request) -> torch.Tensor:
    """The edited image's latents [1, C, 1, hc, wc] as the engine encodes them (untimed), for the diffusers cases."""
    state = engine.start(request)
    while state.condition is None:
        engine.step(state)
    return state.condition


def bench_engine(card: str, device: torch.device, level: int, batch: int) -> Engine:
    return Engine.from_card(card, device=device, opt_level=level, buckets=BucketSpec(batch_sizes=(batch,)),
                            compile_config=CompileConfig(backend="inductor"))  # fmt: skip


def step_workload(card: str, device: torch.device, level: int, batch: int, steps: int) -> dict[str, Case]:
    """perf/profile_step.py's cases: diffusers eager and compile_repeated_blocks, fvgraph at `level`,
    each at `batch`, on the card's default shape."""
    engine = bench_engine(card, device, level, batch)
    s = engine.card.shapes
    work = Workload(engine, device, s.default_height, s.default_width, s.default_frames, steps, batch)
    suffix = "" if batch == 1 else f"_b{batch}"
    cases = {f"diffusers_{kind}{suffix}": work.diffusers_case(f"diffusers_{kind}{suffix}", kind, batch)
             for kind in ("eager", "compile_repeated_blocks")}  # fmt: skip
    cases[f"fvgraph_O{level}{suffix}"] = fvgraph_case(f"fvgraph_O{level}{suffix}", engine, work.request, batch)
    return cases


def bench_shape(card: str, device: torch.device, height: int, width: int, frames: int, repeats: int, warmup: int,
                levels: tuple[int, ...], batch: int, baselines: tuple[str, ...]) -> dict:  # fmt: skip
    steps = min(warmup + repeats + 2, 50)  # one request covers the warmup and the rounds when it can
    # one engine per level and batch: a tick runs every request in its engine, so cases cannot share one
    engines = {(level, b): bench_engine(card, device, level, b) for b in sorted({1, batch}) for level in levels if b == 1 or level > 0}
    any_engine = next(iter(engines.values()))
    work = Workload(any_engine, device, height, width, frames, steps, batch)
    latents, dtype = work.latents, work.dtype

    cases, flops = [], {}
    for b in sorted({1, batch}):
        suffix = "" if b == 1 else f"_b{b}"
        for kind in baselines:
            if kind == "torch_compile" and b != 1:
                continue  # a second whole-model compile for little news: the regional compile covers batch B
            cases.append(work.diffusers_case(f"diffusers_{kind}{suffix}", kind, b))
        for (level, eb), engine in engines.items():  # -O0 runs a batch one request at a time: no -O0 at B
            if eb == b:
                cases.append(fvgraph_case(f"fvgraph_O{level}{suffix}", engine, work.request, b))
    # FLOPs per step: diffusers' math counted once on an eager step (batch 1, scaled by the batch)
    counted = cases[0] if cases[0].name == "diffusers_eager" else None
    step_flops = eager_step_flops(counted) if counted is not None else None
    inputs = {"latents": latents[0], **work.text_inputs, **({} if work.condition is None else {"condition": work.condition})}
    gemms = gemm_cases(step_gemm_shapes(any_engine, inputs, work.branches), device, dtype)
    cases += [case for case, _ in gemms.values()]
    flops.update({name: f for name, (_, f) in gemms.items()})
    samples, warm = _run(cases, repeats, warmup, device)
    for name in samples:  # the FLOPs each case executes per step
        b = batch if name.endswith(f"_b{batch}") and batch > 1 else 1
        if name.startswith("diffusers_") or name == "fvgraph_O0":
            flops[name] = None if step_flops is None else step_flops * b
        elif name.startswith("fvgraph_O"):
            level = int(name.removeprefix("fvgraph_O").split("_")[0])
            counts = [c.flops for c in engines[(level, b)].compiler.compiled_steps if c.flops is not None]
            flops[name] = max(counts) if counts else None  # the denoise step: the other kinds run eager or are far smaller
    gflops = {name: spread([flops[name] / v / 1e9 for v in s], 1.0, 1) for name, s in samples.items() if flops.get(name)}
    gemm_peak = max(gflops[name]["median"] for name in gemms)
    samples = {name: s for name, s in samples.items() if name not in gemms}

    per_step = {name: spread(s, 1e3) for name, s in samples.items()}
    per_request = {name: spread([v / batch for v in s], 1e3) for name, s in samples.items() if name.endswith(f"_b{batch}")}
    speedups, goals = speedups_and_goals(samples, batch)
    return {
        **provenance("step", device), "card": card,
        "shape": {"height": height, "width": width, "frames": frames, "latents": list(latents[0].shape),
                  "text_len": work.pe.shape[1], **({} if work.condition is None else
                                                   {"condition_tokens": condition_tokens(work.condition)})},
        "dtype": str(dtype).removeprefix("torch."), "batch": batch, "per_step_ms": per_step,
        f"per_request_step_ms_b{batch}": per_request, "speedup_per_round": speedups,
        "goals": {name: {"target": GOALS[name], "median": s["median"], "met_by_median": s["median"] >= GOALS[name],
                         "met_by_min": s["min"] >= GOALS[name]} for name, s in goals.items()},
        "gflop_per_step": {name: round(f / 1e9, 3) for name, f in flops.items() if f and name in samples},
        "gflops_per_s": gflops, "gemm_peak_gflops_per_s": gemm_peak,
        "fraction_of_gemm_peak": {name: round(g["median"] / gemm_peak, 3) for name, g in gflops.items() if name in samples},
        "warmup_s_including_compile": {k: round(v, 2) for k, v in warm.items() if k not in gemms},
        "fvgraph_passes_changed": {f"O{level}_b{b}": [s.passes_changed for s in e.compiler._compiled.values()]
                                   for (level, b), e in engines.items() if e.compiler is not None},
    }  # fmt: skip


def speedups_and_goals(samples: dict[str, list[float]], batch: int) -> tuple[dict, dict]:
    """Per-round speedups of fvgraph -O1 over every other case at batch 1 and, per request-step, over
    the diffusers cases at batch B; and the ones the GOALS hold, by goal name."""
    speedups, goals = {}, {}
    if "fvgraph_O1" in samples:
        speedups = {f"O1_vs_{name}": paired_ratio(samples[name], samples["fvgraph_O1"])
                    for name in samples if not name.endswith(f"_b{batch}") and name != "fvgraph_O1"}  # fmt: skip
        if "diffusers_compile_repeated_blocks" in samples:
            goals["O1_vs_compile_repeated_blocks_b1"] = speedups["O1_vs_diffusers_compile_repeated_blocks"]
    ob = f"fvgraph_O1_b{batch}"
    if batch == 1 or ob not in samples:
        return speedups, goals
    for name in (f"diffusers_compile_repeated_blocks_b{batch}", f"diffusers_eager_b{batch}"):
        if name in samples:  # both sides per request-step: the same batch divides out of the ratio
            speedups[f"O1_vs_{name.removeprefix('diffusers_')}_per_request_step"] = paired_ratio(samples[name], samples[ob])
    if "diffusers_compile_repeated_blocks" in samples:  # against diffusers serving one request at a time
        one_at_a_time = [r * batch for r in samples["diffusers_compile_repeated_blocks"]]
        key = "O1_bB_per_request_step_vs_compile_repeated_blocks_b1"
        speedups[key] = goals[key] = paired_ratio(one_at_a_time, samples[ob])
    key = f"O1_vs_compile_repeated_blocks_b{batch}_per_request_step"
    if key in speedups:
        goals["O1_vs_compile_repeated_blocks_per_request_step_bB"] = speedups[key]
    return speedups, goals


def _run(cases: list[Case], repeats: int, warmup: int, device: torch.device):
    """A baseline whose compile fails is reported as the error and left out, not fatal."""
    usable, compile_s = [], {}
    for case in cases:
        if case.name.startswith("diffusers_torch_compile"):
            began = time.perf_counter()
            try:
                case.before()
                case.run()
            except Exception as err:  # noqa: BLE001 (any compile failure: the line records it)
                emit({**provenance("step", device), "case": case.name, "compiles": False,
                      "error": f"{type(err).__name__}: {err}"[:500]})  # fmt: skip
                continue
            compile_s[case.name] = time.perf_counter() - began
        usable.append(case)
    samples, warm = interleaved(usable, repeats, warmup, device)
    return samples, {name: seconds + compile_s.get(name, 0.0) for name, seconds in warm.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="Wan 1.3B config in bf16 on CUDA")
    parser.add_argument("--card", help="default: wan-cpu-bench on the CPU, wan2.1-1.3b-bench with --gpu")
    parser.add_argument("--shapes", nargs="*", help="HxWxF each (default: the card's default shape on CPU; "
                                                    "480x832x33 256x256x17 on GPU)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 10 CPU, 20 GPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--levels", default=None, help="fvgraph opt levels, e.g. 0,1,3 (default CPU) or 0,1,2,3 (GPU)")
    parser.add_argument("--batch", type=int, default=4, help="the lockstep batch besides batch 1 (1: batch 1 only)")
    parser.add_argument("--baselines", default=",".join(BASELINES), help=f"diffusers baselines, from {','.join(BASELINES)}")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; run without --gpu for the CPU (wan-cpu-bench) mode")
    device = torch.device("cuda" if args.gpu else "cpu")
    card = args.card or ("wan2.1-1.3b-bench" if args.gpu else "wan-cpu-bench")
    if args.shapes:
        shapes = args.shapes
    elif args.gpu:
        shapes = ["480x832x33", "256x256x17"]
    else:
        from fvgraph.cards import get_card

        s = get_card(card).shapes
        shapes = [f"{s.default_height}x{s.default_width}x{s.default_frames}"]
    levels = tuple(int(v) for v in (args.levels or ("0,1,2,3" if args.gpu else "0,1,3")).split(","))
    baselines = tuple(b for b in args.baselines.split(",") if b)
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise SystemExit(f"--baselines: unknown {sorted(unknown)}; known: {', '.join(BASELINES)}")
    if args.batch < 1:
        raise SystemExit(f"--batch={args.batch} must be >= 1")
    repeats = args.repeats or (20 if args.gpu else 10)
    for shape in shapes:
        height, width, frames = (int(v) for v in shape.split("x"))
        emit(bench_shape(card, device, height, width, frames, repeats, args.warmup, levels, args.batch, baselines))


if __name__ == "__main__":
    main()
