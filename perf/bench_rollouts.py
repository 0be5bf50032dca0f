"""RL rollout samples per second, interleaved in one process (fvgraph.perf.method): a group of 8
samples of one prompt from the engine against the per-sample Python loop RL codebases sample with.

    python perf/bench_rollouts.py                  # wan-cpu-bench on the CPU, 128x128x9, -O0 eager, 10 steps, 3 rounds
    python perf/bench_rollouts.py --gpu            # Wan 1.3B config, bf16, 480x832x33, -O2 (inductor + CUDA graphs)

Cases (each times one whole group of K = 8 samples, Flow-GRPO's SDE step at noise level 0.7, CFG
at guidance 5.0, latents and per-step log-probs kept, nothing decoded; one untimed warm-up group
per case, compiles included there):

    engine_rollout_k8      `engine.rollout([prompt], group_size=8, seed=..., num_inference_steps=N)`:
                           one text encode, then the 8 samples as requests on the serving loop
                           (batched, CFG fused into one call, from -O1), each with its BehaviorRecord
    private_sampler_loop   what RL codebases run (flow_grpo's Wan sampling with log-probs): a Python
                           for-loop over the samples, one at a time, on an untouched copy of the same
                           diffusers transformer, eager, two transformer calls per step (cond and
                           uncond), flow_grpo's sde_step_with_logprob; the text embeddings computed
                           once before the rounds (diffusers' WanPipeline.encode_prompt), untimed

The opt level is --level: on the GPU 2 by default; on the CPU 0 (eager) by default, since a cold
inductor compile of the rollout step costs minutes on a 2-core CPU (`--level 1` to pay it). At -O0
the engine runs each sample's step on its own too, so on the CPU default the two cases do the same
transformer work and the ratio is what the rest costs.

Prints one JSON line: per case, samples per second (min / median / max over the rounds); per round,
the ratio engine / private loop of samples per second; and the transformer calls per sample of each
case, one per CFG branch and denoise step (counted from the steps the engine ran, and from the
private loop's own calls), beside the engine steps and compiled batches its counters saw.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from diffusers.utils.torch_utils import randn_tensor

from fvgraph.card import ModelCard
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.engine.rollouts import sample_seed
from fvgraph.models.components import diffusers_scheduler
from fvgraph.perf.diffusers_baselines import untouched_components
from fvgraph.perf.method import Case, add_workload_options, emit, interleaved, paired_ratio, provenance, spread, workload
from fvgraph.runtime.buckets import BucketSpec

GROUP = 8
GUIDANCE = 5.0
NOISE_LEVEL = 0.7  # flow_grpo's configs
PROMPT = "a red fox running through fresh snow"
ENGINE, PRIVATE = "engine_rollout_k8", "private_sampler_loop"
WARMUP = 1  # untimed groups per case before the rounds (compiles happen there)


def flow_grpo_sde_step_with_logprob(scheduler, model_output, timestep, sample, noise_level=0.7, prev_sample=None,
                                    generator=None):  # fmt: skip
    """flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_step_with_logprob (calculate_pb=False),
    transcribed as tests/test_rollouts.py has it (the test checks fvgraph's SDE step against it)."""
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [scheduler.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = scheduler.sigmas[step_index].view(-1, *([1] * (sample.dim() - 1)))
    sigma_prev = scheduler.sigmas[prev_step_index].view(-1, *([1] * (sample.dim() - 1)))
    sigma_max = scheduler.sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        variance_noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def engine_case(engine: Engine, shape: dict, steps: int, calls: list[dict]) -> Case:
    """One engine.rollout group per run; every run appends what it ran to `calls` (per group)."""
    kinds = engine.loop.step_kinds
    rounds = itertools.count()  # a new seed per group

    def run():
        seen = {"denoise_steps": 0, "transformer_calls": 0}

        def on_step(state, kind: str) -> None:
            if kinds[kind].phase == "denoise":
                seen["denoise_steps"] += 1
                seen["transformer_calls"] += 2 if "negative_prompt_embeds" in kinds[kind].inputs else 1

        before = engine.counters.snapshot()
        records = engine.rollout([PROMPT], group_size=GROUP, seed=next(rounds), noise_level=NOISE_LEVEL, on_step=on_step,
                                 num_inference_steps=steps, guidance_scale=GUIDANCE, **shape)  # fmt: skip
        assert len(records) == GROUP and all(r.log_probs.shape == (steps,) for r in records)
        grew = engine.counters.since(before)
        calls.append({**seen, "engine_steps": int(grew["eager_steps"] + grew["compiled_steps"]),
                      "batches": int(grew["batches"]), "compiles": int(grew["compiles"])})  # fmt: skip

    return Case(ENGINE, run)


def private_case(card: ModelCard, device: torch.device, weights_version: str, shape: dict, steps: int,
                 calls: list[dict]) -> Case:  # fmt: skip
    """The per-sample loop on its own untouched copy of the card's weights, embeddings encoded once."""
    c = untouched_components(card.card_id, device, weights_version)
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                       scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip
    with torch.no_grad():
        pe, ne = pipe.encode_prompt(PROMPT, negative_prompt="", do_classifier_free_guidance=True,
                                    max_sequence_length=card.shapes.text_len, device=device)  # fmt: skip
    transformer, dtype = c.transformer, c.transformer.dtype
    scheduler = FlowMatchEulerDiscreteScheduler(shift=float(card.recipe.sampler.config.get("flow_shift", 1.0)))
    temporal, spatial = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
    latent_shape = (1, transformer.config.in_channels, (shape["num_frames"] - 1) // temporal + 1,
                    shape["height"] // spatial, shape["width"] // spatial)  # fmt: skip
    rounds = itertools.count()  # a new seed per group

    def run():
        seed, seen = next(rounds), {"denoise_steps": 0, "transformer_calls": 0}
        with torch.no_grad():
            for sample in range(GROUP):
                generator = torch.Generator(device).manual_seed(sample_seed(seed, 0, sample))
                latents = randn_tensor(latent_shape, generator=generator, device=device, dtype=torch.float32)
                scheduler.set_timesteps(steps, device=device)
                trajectory, log_probs = [latents], []
                for t in scheduler.timesteps:
                    x, timestep = latents.to(dtype), t.expand(1)
                    cond = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=pe, return_dict=False)[0]
                    uncond = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=ne, return_dict=False)[0]
                    velocity = uncond + GUIDANCE * (cond - uncond)
                    latents, log_prob, _, _ = flow_grpo_sde_step_with_logprob(scheduler, velocity, t.reshape(1), latents,
                                                                              NOISE_LEVEL, generator=generator)  # fmt: skip
                    trajectory.append(latents)
                    log_probs.append(log_prob)
                    seen["denoise_steps"] += 1
                    seen["transformer_calls"] += 2
                assert len(trajectory) == steps + 1 and torch.cat(log_probs).shape == (steps,)
        calls.append(seen)

    return Case(PRIVATE, run)


def per_group(calls: list[dict], field: str) -> int:
    """A field's value per group, the same in every timed run (each runs the same work)."""
    values = {c[field] for c in calls}
    if len(values) != 1:
        raise RuntimeError(f"{field} differed between the timed groups: {sorted(values)}")
    return values.pop()


def bench(card: ModelCard, device: torch.device, shape: tuple[int, int, int], level: int, steps: int, repeats: int) -> dict:
    height, width, frames = shape
    sizes = {"height": height, "width": width, "num_frames": frames}
    engine = Engine.from_card(card, device=device, opt_level=level, buckets=BucketSpec(batch_sizes=(GROUP,)),
                              compile_config=CompileConfig(backend="inductor"))  # fmt: skip
    calls: dict[str, list[dict]] = {ENGINE: [], PRIVATE: []}
    cases = [engine_case(engine, sizes, steps, calls[ENGINE]),
             private_case(card, device, engine.loop.components.weights_version, sizes, steps, calls[PRIVATE])]  # fmt: skip
    seconds, warm = interleaved(cases, repeats, WARMUP, device)
    dtype = engine.loop.components.transformer.dtype
    engine.close()
    timed = {name: c[WARMUP:] for name, c in calls.items()}
    rate = {name: [GROUP / s for s in values] for name, values in seconds.items()}
    return {
        **provenance("rollouts", device), "card": card.card_id, "opt_level": level, "group_size": GROUP,
        "shape": {"height": height, "width": width, "frames": frames}, "dtype": str(dtype).removeprefix("torch."),
        "steps": steps, "guidance_scale": GUIDANCE, "noise_level": NOISE_LEVEL,
        "samples_per_s": {name: spread(r) for name, r in rate.items()},
        "s_per_group": {name: spread(s) for name, s in seconds.items()},
        # > 1: the engine samples faster (per round: private seconds / engine seconds)
        "samples_per_s_ratio_per_round": {"engine_vs_private": paired_ratio(seconds[PRIVATE], seconds[ENGINE])},
        # one per CFG branch and denoise step; from -O1 the engine runs a step's two as one call over the group
        "transformer_calls_per_sample": {name: per_group(c, "transformer_calls") / GROUP for name, c in timed.items()},
        # the engine's counters per timed group: steps it ran (one per sample and denoise step) and compiled batches
        "engine_per_group": {field: per_group(timed[ENGINE], field) for field in ("engine_steps", "batches", "compiles")},
        "warmup_s_including_compile": {k: round(v, 2) for k, v in warm.items()},
        "warmup_compiles": sum(c["compiles"] for c in calls[ENGINE][:WARMUP]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_options(parser, gpu_shape="480x832x33")
    parser.add_argument("--level", type=int, default=None, help="opt level (default 0 eager on CPU, 2 on GPU)")
    parser.add_argument("--steps", type=int, default=10, help="denoise steps per sample (N)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps={args.steps} must be >= 1")
    card_id, device, shape = workload(args)
    card = get_card(card_id)
    level = args.level if args.level is not None else (2 if args.gpu else 0)
    emit(bench(card, device, shape, level, args.steps, args.repeats))


if __name__ == "__main__":
    main()
