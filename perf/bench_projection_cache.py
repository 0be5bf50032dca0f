"""Eager denoise-step time with and without the Wan projection cache, side by side in one run.

    python perf/bench_projection_cache.py                       # wan-cpu-bench on the CPU
    python perf/bench_projection_cache.py --gpu                 # Wan 1.3B config, bf16, 480x832x33
    python perf/bench_projection_cache.py --gpu --shape 720x1280x81

One transformer (random init; the numbers depend on shapes, not on weight values) and one set of
inputs serve both variants: the cache is applied and removed before each timed call, and the cases
are interleaved (fvgraph.perf.method), so drift in clocks or thermals hits both alike. A step is the
whole CFG DenoiseStep (cond + uncond + UniPC update), timed warm: in steady state every step after a
request's first one hits. The first step of a request (misses plus hashing the prompt embeddings, one
host sync each) is its own case, `first_step_with`. Prints one JSON line, every figure as min /
median / max over the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from diffusers import WanTransformer3DModel

from fvgraph.cards import get_card
from fvgraph.cards.wan import WAN_1_3B_TRANSFORMER, WAN_2_1_T2V_1_3B
from fvgraph.models.components import _cast
from fvgraph.perf.method import Case, emit, interleaved, paired_ratio, provenance, spread
from fvgraph.runtime.projection_cache import ExactProjectionCache
from fvgraph.models.wan_projections import apply_projection_cache, remove_projection_cache
from fvgraph.loops.samplers import build_sampler
from fvgraph.loops.steps import DenoiseStep

VAE_TEMPORAL, VAE_SPATIAL = 4, 8  # Wan VAE: 4 frames and 8x8 pixels per latent
GUIDANCE = 5.0


@dataclasses.dataclass(frozen=True)
class BenchSetup:
    card_id: str
    transformer_config: dict
    dtype: torch.dtype
    device: torch.device
    height: int
    width: int
    frames: int
    text_len: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="Wan 1.3B config, bf16, CUDA (default: tiny-wan, CPU)")
    parser.add_argument("--shape", help="HxWxF, pixels and frames (default: 480x832x33 with --gpu, else the card's)")
    parser.add_argument("--text-len", type=int, help="prompt tokens (default: 512 with --gpu, the card's on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 12 CPU, 10 GPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before timing")
    parser.add_argument("--max-bytes", type=int, default=2 * 1024**3, help="cache byte budget")
    return parser.parse_args(argv)


def bench_setup(args: argparse.Namespace) -> BenchSetup:
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit(
                "bench_projection_cache: --gpu needs a CUDA device, and torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); run without --gpu for the CPU mode."
            )
        card_id, config, dtype, device = WAN_2_1_T2V_1_3B.card_id, WAN_1_3B_TRANSFORMER, torch.bfloat16, "cuda"
        shape, text_len = args.shape or "480x832x33", args.text_len or 512
    else:
        card = get_card("wan-cpu-bench")
        card_id, config, dtype, device = card.card_id, card.components["transformer"].config, torch.float32, "cpu"
        s = card.shapes
        shape = args.shape or f"{s.default_height}x{s.default_width}x{s.default_frames}"
        text_len = args.text_len or s.text_len
    try:
        height, width, frames = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bench_projection_cache: --shape={shape!r} must be HxWxF, e.g. 480x832x33") from None
    return BenchSetup(card_id, dict(config), dtype, torch.device(device), height, width, frames, text_len)


def build_step(setup: BenchSetup) -> DenoiseStep:
    """A CFG DenoiseStep over a randomly initialised transformer, cast like from_pretrained."""
    with torch.device(setup.device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(**setup.transformer_config)
    transformer = _cast(transformer, setup.dtype).eval().requires_grad_(False)
    sampler = build_sampler(WAN_2_1_T2V_1_3B.recipe.sampler)  # the UniPC config every Wan card uses
    return DenoiseStep(transformer, sampler, cfg=True).eval()


def build_inputs(setup: BenchSetup, step: DenoiseStep) -> dict[str, torch.Tensor]:
    config, device = setup.transformer_config, setup.device
    g = torch.Generator().manual_seed(0)
    latent_shape = (
        1,
        config["in_channels"],
        (setup.frames - 1) // VAE_TEMPORAL + 1,
        setup.height // VAE_SPATIAL,
        setup.width // VAE_SPATIAL,
    )
    latents = torch.randn(latent_shape, generator=g).to(device)
    embeds = [torch.randn(1, setup.text_len, config["text_dim"], generator=g).to(device, setup.dtype) for _ in range(2)]
    plan = step.sampler.plan(10)
    inputs = {
        "latents": latents,
        "timestep": plan.timesteps[1:2].to(device),  # step 1: the corrector and predictor rows both run
        "prompt_embeds": embeds[0],
        "negative_prompt_embeds": embeds[1],
        "coeffs": plan.coeffs[1:2].to(device),
        "guidance_scale": torch.tensor([GUIDANCE], device=device),
    }
    inputs.update({f"carry_{i}": t for i, t in enumerate(step.sampler.initial_carry(latents))})
    return inputs


def run(args: argparse.Namespace) -> dict:
    setup = bench_setup(args)
    step = build_step(setup)
    inputs = build_inputs(setup, step)
    transformer, cache = step.transformer, ExactProjectionCache(max_bytes=args.max_bytes)
    state = {"applied": False}
    counts: list[tuple[int, int]] = []  # (hits, misses) of each "with" call, its warmup calls first

    def use_cache(on: bool, cold: bool = False) -> None:
        if on and not state["applied"]:
            apply_projection_cache(transformer, cache)
        elif not on and state["applied"]:
            remove_projection_cache(transformer)
        state["applied"] = on
        if cold:
            cache.clear()  # a new request: every projection misses and the embeddings are hashed again

    def call():
        with torch.no_grad():
            return step(**inputs)

    def counted_call():
        before = cache.stats
        call()
        after = cache.stats
        counts.append((after.hits - before.hits, after.misses - before.misses))

    cases = [
        Case("without", call, before=lambda: use_cache(False)),
        Case("with", counted_call, before=lambda: use_cache(True)),
        Case("first_step_with", call, before=lambda: use_cache(True, cold=True)),
    ]
    samples, _ = interleaved(cases, args.repeats or (10 if args.gpu else 12), args.warmup, setup.device)
    use_cache(False)
    hits, misses = (sum(c[k] for c in counts[args.warmup :]) for k in (0, 1))
    return {
        **provenance("projection_cache", setup.device), "card": setup.card_id,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "shape": {"height": setup.height, "width": setup.width, "frames": setup.frames, "text_len": setup.text_len,
                  "latents": list(inputs["latents"].shape)},  # fmt: skip
        "per_step_ms": {name: spread(values, 1e3) for name, values in samples.items()},
        "speedup_per_round": paired_ratio(samples["without"], samples["with"]),
        "hit_rate_with": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "stats": dataclasses.asdict(cache.stats),
    }


def main(argv: list[str] | None = None) -> None:
    emit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
