"""Seconds per request, interleaved in one process (fvgraph.perf.method): a 4-step distilled recipe
against the 50-step base recipe with CFG, on the same weights.

    python perf/bench_distilled.py                 # wan-cpu-bench on the CPU, 128x128x9, -O0 eager, 3 rounds
    python perf/bench_distilled.py --gpu           # Wan 1.3B config, bf16, 480x832x81, -O1 inductor

Cases (each times one whole request, `engine.generate([request])`, latents out, prompt embeddings
given so no text encoder runs; one untimed warm-up request per case, compiles included there):

    base_50step_cfg   the card's base recipe: UniPC, --base-steps steps (50), guidance 5.0, so two
                      denoiser branches per step (fused into one batch-2 call from -O1)
    distilled_4step   the same card and weights under LightX2V's 4-step recipe (cards/wan_distill.py:
                      few_step_renoise on timesteps [1000, 750, 500, 250], shift 5), no guidance: one
                      branch per step

Each case has its own engine: the recipe is the card's. The weights are seeded by the card's seed and
the component's name, so both engines run the same transformer. The weights were never distilled, so
the distilled videos mean nothing; only their cost does.

The opt level is --level: on the GPU 1 (inductor) by default; on the CPU 0 (eager) by default,
since a cold inductor compile of the step costs minutes on a 2-core CPU (`--level 1` to pay it).

Prints one JSON line: per case, seconds per request (min / median / max over the rounds); per round,
the ratio base / distilled; and the transformer calls per request of each case, one per CFG branch
and denoise step, counted from the steps the engine ran (its on_step callback and the step kind's
declared inputs), beside the steps its counters saw.
"""

from __future__ import annotations

import argparse

import torch

from fvgraph.card import ModelCard
from fvgraph.cards import get_card
from fvgraph.cards.wan_distill import LIGHTX2V_4STEP, _distilled
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.perf.method import Case, add_workload_options, emit, interleaved, paired_ratio, provenance, spread, workload
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec

GUIDANCE = 5.0
BASE, DISTILLED = "base_50step_cfg", "distilled_4step"
WARMUP = 1  # untimed requests per case before the rounds (compiles happen there)


def distilled_card(base: ModelCard) -> ModelCard:
    """`base` under LightX2V's 4-step recipe, as cards/wan_distill.py builds tiny-wan-4step."""
    return _distilled(base, f"{base.card_id}-4step", "lightx2v-4step", LIGHTX2V_4STEP, assumes_precision=None)


def request_case(name: str, engine: Engine, request: Request, calls: list[dict]) -> Case:
    """One whole request per run. Every run appends what it ran to `calls`: its denoise steps, its
    transformer calls (a step whose kind takes negative_prompt_embeds runs the uncond branch too),
    and the steps and compiles the engine's counters saw (the warm-up request's compiles included)."""
    kinds = engine.loop.step_kinds

    def run():
        seen = {"denoise_steps": 0, "transformer_calls": 0}

        def on_step(state, kind: str) -> None:
            if kinds[kind].phase == "denoise":
                seen["denoise_steps"] += 1
                seen["transformer_calls"] += 2 if "negative_prompt_embeds" in kinds[kind].inputs else 1

        before = engine.counters.snapshot()
        [result] = engine.generate([request], on_step=on_step)
        assert result.ok, f"{name}: {result.status}: {result.error}"
        grew = engine.counters.since(before)
        steps = int(grew["eager_steps"] + grew["compiled_steps"])
        calls.append({**seen, "engine_steps": steps, "compiles": int(grew["compiles"])})

    return Case(name, run)


def per_request(calls: list[dict]) -> dict:
    """What each request of a case ran: one value per field when every run agrees (they should:
    the same request on the same engine), else every run's, in order."""
    ran = {}
    for field in calls[0]:
        values = [c[field] for c in calls]
        ran[field] = values[0] if len(set(values)) == 1 else values
    return ran


def bench(card: ModelCard, device: torch.device, shape: tuple[int, int, int], level: int, base_steps: int,
          repeats: int) -> dict:  # fmt: skip
    height, width, frames = shape
    common = dict(device=device, opt_level=level, text_encoder=False, buckets=BucketSpec(batch_sizes=(1,)),
                  compile_config=CompileConfig(backend="inductor"))  # fmt: skip
    engines = {BASE: Engine.from_card(card, **common), DISTILLED: Engine.from_card(distilled_card(card), **common)}
    base = engines[BASE]
    g = torch.Generator().manual_seed(0)
    pe, ne = (torch.randn(base.card.shapes.text_len, base.facts.text_dim, generator=g) for _ in range(2))
    shared = dict(prompt_embeds=pe, height=height, width=width, num_frames=frames, seed=0, output_type="latent")
    requests = {
        BASE: Request(**shared, negative_prompt_embeds=ne, guidance_scale=GUIDANCE, num_inference_steps=base_steps),
        DISTILLED: Request(**shared),  # the recipe's own steps and guidance (1: one branch)
    }
    calls: dict[str, list[dict]] = {name: [] for name in engines}
    cases = [request_case(name, engines[name], requests[name], calls[name]) for name in engines]
    samples, warm = interleaved(cases, repeats, WARMUP, device)
    for engine in engines.values():
        engine.close()
    dtype = base.loop.components.transformer.dtype
    return {
        **provenance("distilled", device), "card": card.card_id, "distilled_card": engines[DISTILLED].card.card_id,
        "opt_level": level, "shape": {"height": height, "width": width, "frames": frames},
        "dtype": str(dtype).removeprefix("torch."), "guidance_scale": GUIDANCE,
        "steps": {BASE: base_steps, DISTILLED: engines[DISTILLED].card.recipe.default_steps},
        "s_per_request": {name: spread(s) for name, s in samples.items()},
        "time_ratio_per_round": {"base_vs_distilled": paired_ratio(samples[BASE], samples[DISTILLED])},  # > 1: base slower
        # one per CFG branch and denoise step; from -O1 a CFG step's two run as one batch-2 call
        "transformer_calls_per_request": {name: per_request(c[WARMUP:])["transformer_calls"] for name, c in calls.items()},
        "ran_per_request": {name: per_request(c[WARMUP:]) for name, c in calls.items()},  # the timed requests
        "warmup_s_including_compile": {k: round(v, 2) for k, v in warm.items()},
        "warmup_compiles": {name: sum(r["compiles"] for r in c[:WARMUP]) for name, c in calls.items()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_options(parser, gpu_shape="480x832x81")  # --card: the base card
    parser.add_argument("--level", type=int, default=None, help="opt level (default 0 eager on CPU, 1 inductor on GPU)")
    parser.add_argument("--base-steps", type=int, default=50, help="the base case's UniPC steps")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args(argv)
    if args.base_steps < 1:
        raise SystemExit(f"--base-steps={args.base_steps} must be >= 1")
    card_id, device, shape = workload(args)
    card = get_card(card_id)
    level = args.level if args.level is not None else (1 if args.gpu else 0)
    emit(bench(card, device, shape, level, args.base_steps, args.repeats))


if __name__ == "__main__":
    main()
