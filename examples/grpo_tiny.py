"""A small Flow-GRPO trainer on tiny-wan, on the CPU, as a client of the engine: the engine samples
the rollouts (`engine.rollout`), the trainer holds its own copy of the transformer and the VAE,
scores the decoded videos, takes clipped-PPO steps on the recorded transitions, and syncs its
weights back into the engine (`engine.update_weights`). The engine never imports this file.

    python examples/grpo_tiny.py                            # 30 iterations: about a minute on 2 idle cores
    python examples/grpo_tiny.py --seed 1 --out /tmp/grpo   # also reward_curve.json and reward_curve.png

Each iteration:

1. Rollouts: `engine.rollout(PROMPTS, group_size=K, seed=it, ...)` at 48x64x5, N denoise steps,
   guidance 1.0 (one transformer call per step on both sides; the CFG combine below is there for
   `--guidance` above 1). Each record must carry the weights version last synced.
2. Reward, from the decoded video: the record's final latents denormalized with the VAE's
   latents_mean / latents_std, decoded by the trainer's own VAE, /2 + 0.5, clamped to [0, 1]
   (what fvgraph/loops/steps.py VaeDecodeStep does), then redness = mean(R) - mean(B) over all
   frames and pixels. The tiny VAE's weights are seeded, not trained, so the video means nothing;
   redness is a smooth function of the latents the policy controls, so it moves.
3. GRPO advantages per group (one prompt's samples): (r - mean) / (std + 1e-4), clipped to +-5.
4. For each of `--inner-epochs` passes: for every record and step i, the trainer's transformer in
   train mode (autograd on) gives v on the recorded latents[i] at the recorded timestep (with the
   CFG combine when guidance_scale > 1); the mean a * x + b * v from the record's coeffs row
   [sigma, a, b, c], and the Gaussian log-density of latents[i + 1] around it with std c averaged
   over elements, as FlowSdeSampler.update and flow_grpo's sde_step_with_logprob compute it. Then
   ratio = exp(new - recorded) and flow_grpo's clipped loss max(-A ratio, -A clip(ratio, 1 - eps,
   1 + eps)), averaged over records and steps; one Adam step on the full weights per pass.
   eps = 0.2 (PPO's; flow_grpo's SD3 configs use 1e-4): with a single pass, the default, the
   first pass is on-policy (ratio 1), so the clip only matters from a second pass on.
5. Every `--sync-every` optimizer steps the trainer's parameters go into the engine as
   version `step-{k}`.

The first pass's largest |new - recorded| log-prob, before any update of that iteration, is the C2
rung (recorded log-probs equal train-forward ones) while the engine runs the weights the trainer has:
7e-7 on the seeded weights, growing as training moves them (measured: under 1e-5 over the first 12
iterations, 3e-5 to 1.1e-4 by iterations 25-30 at lr 3e-2; most likely the trainer's batched forward
and the engine's per-sample one rounding apart, divided by the small std c of the last steps). With `--sync-every` above the optimizer steps per
iteration, the engine samples on older weights and that gap is the policy's real lag, not a mismatch.

Prints the mean reward per iteration, then one JSON line of the run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from fvgraph.behavior import BehaviorRecord
from fvgraph.cards import get_card
from fvgraph.engine.engine import Engine
from fvgraph.models.components import load_components

CARD = "tiny-wan"
PROMPTS = ("a red fox in the snow", "a lighthouse at dusk")
SHAPE = {"height": 48, "width": 64, "num_frames": 5}
HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)
ADV_CLIP = 5.0  # flow_grpo's adv_clip_max


class VideoReward:
    """Redness of the decoded video, scored by the trainer's own VAE."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae.eval().requires_grad_(False)
        z_dim = vae.config.z_dim
        self.mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
        self.std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)

    @torch.no_grad()
    def __call__(self, records: list[BehaviorRecord]) -> torch.Tensor:
        latents = torch.cat([r.latents[-1:] for r in records])  # [B, C, F, h, w], normalized
        video = self.vae.decode(latents * self.std + self.mean, return_dict=False)[0]
        video = (video / 2 + 0.5).clamp(0, 1)  # [B, 3, F, H, W]
        return video[:, 0].mean(dim=(1, 2, 3)) - video[:, 2].mean(dim=(1, 2, 3))


def group_advantages(rewards: torch.Tensor, groups: list[int]) -> torch.Tensor:
    """(r - mean) / (std + 1e-4) within each group (the population std), clipped to +-ADV_CLIP."""
    groups_t = torch.tensor(groups)
    advantages = torch.empty_like(rewards)
    for g in groups_t.unique():
        member = groups_t == g
        r = rewards[member]
        advantages[member] = (r - r.mean()) / (r.std(correction=0) + 1e-4)  # np.std, as flow_grpo's stat tracker
    return advantages.clamp(-ADV_CLIP, ADV_CLIP)


def transition_log_probs(transformer: torch.nn.Module, records: list[BehaviorRecord], i: int) -> torch.Tensor:
    """log p(latents[i + 1] | latents[i]) [B] of every record under `transformer`, with autograd:
    one batched forward (two with CFG) on the recorded latents, as FlowSdeSampler.update."""
    x = torch.stack([r.latents[i] for r in records])
    t = torch.stack([r.timesteps[i] for r in records])
    following = torch.stack([r.latents[i + 1] for r in records])
    a, b, c = (torch.stack([r.coeffs[i, j] for r in records]).view(-1, 1, 1, 1, 1) for j in (1, 2, 3))
    v = transformer(x, t, torch.stack([r.prompt_embeds for r in records]), return_dict=False)[0]
    scales = torch.tensor([r.guidance_scale for r in records]).view(-1, 1, 1, 1, 1)
    if (scales > 1).any():  # records without CFG (scale 1) keep v = cond
        negative = torch.stack([r.negative_prompt_embeds if r.guidance_scale > 1 else r.prompt_embeds for r in records])
        uncond = transformer(x, t, negative, return_dict=False)[0]
        v = torch.where(scales > 1, uncond + scales * (v - uncond), v)
    mean = a * x + b * v.float()
    log_prob = -((following - mean) ** 2) / (2 * c**2) - torch.log(c) - HALF_LOG_TWO_PI
    return log_prob.mean(dim=(1, 2, 3, 4))


def ppo_pass(transformer, optimizer, records, advantages, clip_range: float) -> tuple[float, float]:
    """One clipped-PPO pass over every record and step, one optimizer step. Returns (loss, the
    largest |new - recorded| log-prob before the step)."""
    optimizer.zero_grad(set_to_none=True)
    old = torch.stack([r.log_probs for r in records])  # [B, N]
    steps = records[0].num_steps
    total, gap = 0.0, 0.0
    for i in range(steps):  # one backward per step: the autograd graph of one step at a time
        new = transition_log_probs(transformer, records, i)
        gap = max(gap, float((new.detach() - old[:, i]).abs().max()))
        ratio = torch.exp(new - old[:, i])
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
        loss = torch.maximum(unclipped, clipped).mean() / steps
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total, gap


def run(iterations: int, group_size: int, steps: int, lr: float, seed: int, sync_every: int, inner_epochs: int,
        clip_range: float, guidance: float) -> dict:  # fmt: skip
    torch.manual_seed(seed)
    card = get_card(CARD)
    engine = Engine.from_card(CARD, device="cpu")
    trainer_side = load_components(card, None, torch.device("cpu"))  # an untouched copy of the seeded weights
    transformer = trainer_side.transformer.requires_grad_(True).train()
    reward = VideoReward(trainer_side.vae)
    optimizer = torch.optim.Adam(transformer.parameters(), lr=lr)
    version, optimizer_steps = engine.loop.components.weights_version, 0
    curve, gaps, versions, synced = [], [], [], []
    began = time.perf_counter()
    for it in range(iterations):
        # rollout seeds are (seed, iteration): another --seed draws other noise from the same weights
        records = engine.rollout(list(PROMPTS), group_size=group_size, seed=seed * 100_000 + it, num_inference_steps=steps,
                                 guidance_scale=guidance, **SHAPE)  # fmt: skip
        seen = sorted({r.provenance["weights_version"] for r in records})
        if seen != [version]:
            raise RuntimeError(f"iteration {it}: records carry weights {seen}, the engine was synced to {version!r}")
        versions.append(version)
        rewards = reward(records)
        curve.append(float(rewards.mean()))
        advantages = group_advantages(rewards, [r.group for r in records])
        for epoch in range(inner_epochs):
            _, gap = ppo_pass(transformer, optimizer, records, advantages, clip_range)
            if epoch == 0:
                gaps.append(gap)
            optimizer_steps += 1
            if optimizer_steps % sync_every == 0:
                version = f"step-{optimizer_steps}"
                engine.update_weights({n: p.detach() for n, p in transformer.named_parameters()}, version=version)
                synced.append(version)
        print(f"iteration {it:3d}  mean reward {curve[-1]:+.5f}  first-pass log-prob gap {gaps[-1]:.2e}", flush=True)
    engine.close()
    return {
        "example": "grpo_tiny", "card": CARD, "prompts": list(PROMPTS), "shape": SHAPE, "seed": seed,
        "iterations": iterations, "group_size": group_size, "num_inference_steps": steps, "guidance_scale": guidance,
        "lr": lr, "clip_range": clip_range, "inner_epochs": inner_epochs, "sync_every": sync_every,
        "reward": "redness: mean(R) - mean(B) of the decoded frames in [0, 1]",
        "mean_reward": [round(r, 6) for r in curve],
        "first_epoch_logprob_gap": [float(f"{g:.3e}") for g in gaps],  # max |new - recorded|, before any update
        "record_weights_version": versions, "synced_versions": synced,
        "seconds": round(time.perf_counter() - began, 1),
    }  # fmt: skip


def write_curve(result: dict, folder: Path) -> dict[str, Path]:
    """reward_curve.json (the run's JSON) and reward_curve.png (mean reward per iteration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "reward_curve.json", "png": folder / "reward_curve.png"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(len(result["mean_reward"])), result["mean_reward"], marker="o", markersize=3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward (redness)")
    ax.set_title(f"Flow-GRPO on {result['card']}, seed {result['seed']}")
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=100)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=6, help="K samples per prompt")
    parser.add_argument("--steps", type=int, default=4, help="N denoise steps per rollout")
    parser.add_argument("--lr", type=float, default=3e-2, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="rollout seeds derive from (seed, iteration)")
    parser.add_argument("--sync-every", type=int, default=1, help="optimizer steps between weight syncs")
    parser.add_argument("--inner-epochs", type=int, default=1, help="PPO passes (optimizer steps) per iteration")
    parser.add_argument("--clip-range", type=float, default=0.2)
    parser.add_argument("--guidance", type=float, default=1.0, help="guidance scale (> 1: CFG on both sides)")
    parser.add_argument("--out", type=Path, help="write reward_curve.json and reward_curve.png here")
    args = parser.parse_args(argv)
    least = {"iterations": 1, "group_size": 2, "steps": 1, "sync_every": 1, "inner_epochs": 1}  # a group needs a spread
    for name, low in least.items():
        if getattr(args, name) < low:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {low}")
    result = run(args.iterations, args.group_size, args.steps, args.lr, args.seed, args.sync_every, args.inner_epochs,
                 args.clip_range, args.guidance)  # fmt: skip
    if args.out is not None:
        result["files"] = {k: str(p) for k, p in write_curve(result, args.out).items()}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
