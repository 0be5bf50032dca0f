"""Step caching, method by method: wall time, FLOPs and quality against the uncached run, beside
diffusers' own cache hooks on untouched copies of the same weights (fvgraph.perf.method: interleaved).

    python perf/bench_interceptors.py                      # wan-cpu-bench, 9x128x128, 10 steps, -O1
    python perf/bench_interceptors.py --gpu --methods magcache   # Wan 1.3B config, bf16, 480x832x17, 50 steps, -O2

For each method in fvgraph.caching.methods.METHODS (or --methods) at its published setting
(PUBLISHED, else the method's defaults; --setting METHOD:k=v,... overrides), calibrated on these
weights first when the method calibrates (MagCache's ratios: fvgraph.caching.calibration_store), one
case is a whole request's denoise loop (every step, both CFG branches, no text encoder or VAE):

    fvgraph_none, fvgraph_<method>                    one Engine at --opt-level, caching off / on
    diffusers_<baseline>_none, diffusers_<baseline>_<method>
                                                      WanPipeline on its own untouched copy of the
                                                      weights, with `transformer.enable_cache(...)`
                                                      (perf/diffusers_cache_configs.py) where diffusers
                                                      has the method; baselines: eager, compile_repeated_blocks
                                                      (fullgraph=False with hooks on: they disable compile
                                                      around the blocks' forwards)

Prints one JSON line: per case the wall time (ms, min / median / max over interleaved rounds); per
method the per-round speedup over its side's uncached case (and whether fvgraph's is at least
diffusers', the issue's goal), fvgraph's FLOPs ratio (the step graphs
that ran over the uncached step's, Result.cache), the denoiser calls computed and reused, and the
quality distance from the uncached run (fvgraph.step_caching_quality: relative L2 of the final latents,
PSNR of the decoded frames). Compiles happen in the untimed warmup and are reported apart.
"""

from __future__ import annotations

import argparse
import time

import torch
from diffusers import WanPipeline

from fvgraph.step_caching_quality import cache_distance
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.calibrate import calibrate
from fvgraph.caching.settings import CacheSettings, parse_cache_text
from fvgraph.caching.methods import METHODS, parse_cache_settings
from fvgraph.models.components import diffusers_scheduler
from fvgraph.perf.diffusers_baselines import baseline_transformer, untouched_components
from fvgraph.perf.diffusers_cache_configs import diffusers_cache_config
from fvgraph.perf.method import Case, emit, interleaved, paired_ratio, provenance, spread
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.engine.engine import Engine

GUIDANCE = 5.0
BASELINES = ("eager", "compile_repeated_blocks")
# The setting each method is benchmarked at, where it differs from the method's defaults. MagCache:
# diffusers' MagCacheConfig defaults (threshold 0.06, K = max_skip_steps 3, retention 0.2).
PUBLISHED: dict[str, dict] = {
    "magcache": {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2},  # diffusers' MagCacheConfig defaults
    "teacache": {"threshold": 0.08},  # TeaCache4Wan2.1's faster setting for Wan 2.1 1.3B
    "fbcache": {"threshold": 0.06},  # FBCache's reported Wan 14B setting (diffusers' default: 0.05)
}  # TaylorSeer: diffusers' TaylorSeerCacheConfig defaults


def method_settings(engine: Engine, method: str, overrides: dict, request: Request) -> CacheSettings:
    """The method at its published setting, with calibrated fields measured on the engine's weights."""
    settings = parse_cache_settings({"method": method, **PUBLISHED.get(method, {}), **overrides})
    if settings.missing_calibration():
        fields = request.model_dump(include={"prompt_embeds", "negative_prompt_embeds", "guidance_scale", "height",
                                             "width", "num_frames"})  # fmt: skip
        record, _ = calibrate(engine, method, request.num_inference_steps, seed=request.seed, **fields)
        settings = settings.calibrated(record["values"])
    return settings


def fvgraph_case(name: str, engine: Engine, request: Request, results: dict) -> Case:
    def run():
        [result] = engine.generate([request.model_copy()])
        assert result.ok, result.error
        results[name] = result

    return Case(name, run)


def diffusers_case(name: str, pipe: WanPipeline, request: Request) -> Case:
    device = pipe.transformer.device
    pe, ne = (t[None].to(device, pipe.transformer.dtype) for t in (request.prompt_embeds, request.negative_prompt_embeds))

    def run():
        with torch.no_grad():
            pipe(prompt_embeds=pe, negative_prompt_embeds=ne, guidance_scale=request.guidance_scale, height=request.height,
                 width=request.width, num_frames=request.num_frames, num_inference_steps=request.num_inference_steps,
                 generator=torch.Generator().manual_seed(request.seed), output_type="latent")  # fmt: skip

    return Case(name, run)


def diffusers_pipe(card: str, device: torch.device, version: str, sampler, baseline: str, config) -> WanPipeline:
    """WanPipeline on an untouched copy of the weights: cache hooks first, then the baseline's compile."""
    c = untouched_components(card, device, version)
    if config is None:
        transformer = baseline_transformer(baseline, c)
    else:
        c.transformer.enable_cache(config)
        transformer = c.transformer
        if baseline == "compile_repeated_blocks":
            # diffusers' hooks wrap the blocks' forwards in torch.compiler.disable, which fullgraph=True
            # refuses (measured: "Skip calling `torch.compiler.disable()`d function"): with hooks on,
            # the regional compile runs with graph breaks, as a diffusers user has to run it.
            transformer.compile_repeated_blocks(fullgraph=False)
        elif baseline != "eager":
            raise ValueError(f"baseline={baseline!r}: expected one of {BASELINES}")
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=transformer,
                       scheduler=diffusers_scheduler(sampler))  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def bench(args: argparse.Namespace, device: torch.device) -> dict:
    height, width, frames = (int(v) for v in args.shape.lower().split("x"))
    engine = Engine.from_card(args.card, device=device, opt_level=args.opt_level, buckets=BucketSpec(batch_sizes=(1,)),
                              compile_config=CompileConfig(backend=args.backend))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    pe, ne = (torch.randn(engine.card.shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(2))
    request = Request(prompt_embeds=pe, negative_prompt_embeds=ne, guidance_scale=GUIDANCE, height=height, width=width,
                      num_frames=frames, seed=0, num_inference_steps=args.steps, output_type="latent", cache="none")  # fmt: skip
    overrides = {}
    for text in args.setting:
        spec = parse_cache_text(text)
        overrides[spec.pop("method")] = spec
    methods = args.methods.split(",") if args.methods else list(METHODS)
    settings = {m: method_settings(engine, m, overrides.get(m, {}), request) for m in methods}

    fv_results: dict = {}
    cases = [fvgraph_case("fvgraph_none", engine, request, fv_results)]
    cases += [fvgraph_case(f"fvgraph_{m}", engine, request.model_copy(update={"cache": s}), fv_results) for m, s in settings.items()]
    version, sampler, errors = engine.loop.components.weights_version, engine.card.recipe.sampler, {}
    for baseline in args.baselines.split(",") if args.baselines else ():
        for m, s in {"none": None, **settings}.items():
            config = None if s is None else diffusers_cache_config(s, args.steps)
            if s is not None and config is None:
                continue  # diffusers has no such method
            name = f"diffusers_{baseline}_{m}"
            try:
                cases.append(diffusers_case(name, diffusers_pipe(args.card, device, version, sampler, baseline, config), request))
            except Exception as err:  # noqa: BLE001 (a baseline that cannot be built: the line records it)
                errors[name] = f"{type(err).__name__}: {err}"[:500]
    samples, warm = _interleaved(cases, args.repeats, args.warmup, device, errors)

    report = {}
    for m, s in settings.items():
        cached = fv_results[f"fvgraph_{m}"].cache
        quality = cache_distance(engine, [request.model_copy(update={"output_type": "np", "cache": None})], s).requests[0]
        line = {"setting": s.model_dump(mode="json", exclude={"mag_ratios"}),
                "fvgraph": {"wall_ms": spread(samples[f"fvgraph_{m}"], 1e3),
                            "speedup": paired_ratio(samples["fvgraph_none"], samples[f"fvgraph_{m}"]),
                            "flops_ratio": round(cached["flops"] / cached["flops_uncached"], 4),
                            "computed": cached["computed"], "reused": cached["reused"]},
                "quality": {"final_rel_l2": quality.final_rel_l2, "rel_l2_per_step": quality.rel_l2, "psnr_db": quality.psnr}}  # fmt: skip
        for baseline in BASELINES:
            none, ours = f"diffusers_{baseline}_none", f"diffusers_{baseline}_{m}"
            if ours in samples and none in samples:
                theirs = paired_ratio(samples[none], samples[ours])
                line[f"diffusers_{baseline}"] = {"wall_ms": spread(samples[ours], 1e3), "speedup": theirs}
                # the goal: caching speeds fvgraph up at least as much as it speeds diffusers up
                line.setdefault("goals", {})[f"speedup_at_least_diffusers_{baseline}"] = {
                    "fvgraph_median": line["fvgraph"]["speedup"]["median"], "diffusers_median": theirs["median"],
                    "met_by_median": line["fvgraph"]["speedup"]["median"] >= theirs["median"]}  # fmt: skip
        report[m] = line
    return {
        **provenance("interceptors", device), "card": args.card, "opt_level": engine.opt_level,
        "shape": {"height": height, "width": width, "frames": frames}, "steps": args.steps, "guidance": GUIDANCE,
        "uncached_wall_ms": {name: spread(v, 1e3) for name, v in samples.items() if name.endswith("_none")},
        "methods": report, "errors": errors, "warmup_s_including_compile": {k: round(v, 2) for k, v in warm.items()},
    }  # fmt: skip


def _interleaved(cases: list[Case], repeats: int, warmup: int, device: torch.device, errors: dict):
    """A diffusers case that fails in its first call (a compile with hooks, say) is recorded and left out."""
    usable, first_call = [], {}
    for case in cases:
        if case.name.startswith("diffusers_"):
            began = time.perf_counter()
            try:
                case.run()
            except Exception as err:  # noqa: BLE001
                errors[case.name] = f"{type(err).__name__}: {err}"[:500]
                continue
            first_call[case.name] = time.perf_counter() - began  # its compile, if any, happened here
        usable.append(case)
    samples, warm = interleaved(usable, repeats, max(warmup, 1), device)  # warmup >= 1: compiles stay untimed
    return samples, {name: seconds + first_call.get(name, 0.0) for name, seconds in warm.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="Wan 1.3B config in bf16 on CUDA, 480x832x17, 50 steps, -O2")
    parser.add_argument("--card", help="default: wan-cpu-bench on the CPU, wan2.1-1.3b-bench with --gpu")
    parser.add_argument("--shape", help="HxWxF (default 128x128x9 CPU, 480x832x17 GPU)")
    parser.add_argument("--steps", type=int, help="inference steps (default 10 CPU, 50 GPU)")
    parser.add_argument("--methods", help=f"comma separated, from {','.join(METHODS)} (default: all)")
    parser.add_argument("--setting", action="append", default=[], help="METHOD:k=v,... over its published setting (repeatable)")
    parser.add_argument("-O", "--opt-level", type=int, help="fvgraph opt level (default 1 CPU, 2 GPU)")
    parser.add_argument("--backend", default="inductor", help="compile backend at -O1 and up")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="diffusers baselines ('' for none)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.gpu else "cpu")
    args.card = args.card or ("wan2.1-1.3b-bench" if args.gpu else "wan-cpu-bench")
    args.shape = args.shape or ("480x832x17" if args.gpu else "128x128x9")
    args.steps = args.steps or (50 if args.gpu else 10)
    args.opt_level = args.opt_level if args.opt_level is not None else (2 if args.gpu else 1)
    emit(bench(args, device))


if __name__ == "__main__":
    main()
