"""Samplers as pure tensor updates with host-planned coefficients.

diffusers' schedulers keep their progress in the scheduler object (step index, model-output history),
so one instance cannot serve interleaved requests, and their Python branches on the step index cannot
live in one compiled graph. Here a sampler is split in two:

- `plan(num_steps)` (host, once per request): the timesteps diffusers' own `set_timesteps` produces,
  and one row of float coefficients per step. Every branch on the step index (warm-up order,
  corrector on/off, the final step) is folded into these numbers.
- `update(sample, model_output, carry, coeffs)` (inside the step): a fixed linear combination, the
  same ops at every step, with per-request coefficients as batch-dim tensors. Requests at different
  steps therefore share one graph, and the per-request history (`carry`) lives in the request's state.

Flow-matching Euler:  x' = x + (sigma_next - sigma) * v.
Few-step samplers of distilled recipes, on the recipe's own timestep list (fvgraph/recipe.py): Euler as
above, or the re-noising update of DMD / self-forcing students (LightX2V's WanStepDistillScheduler,
FastVideo's DMD loop): x0 = x - sigma * v, then x' = (1 - sigma_next) * x0 + sigma_next * noise, with
fresh noise the loop draws from the request's own generator (an input of the step, like the latents).
UniPC (bh1/bh2, predict_x0, flow sigmas), as diffusers' UniPCMultistepScheduler: with x0 = x - sigma*v,
the corrector rebuilds the current sample from the previous one and the x0 history, then the predictor
steps to the next sigma. Both are linear in (x, x_last, x0, history), so each reduces to a row of weights.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from fvgraph.recipe import TRAIN_TIMESTEPS, SamplerSpec


MAX_SOLVER_ORDER = 3  # UniPC's orders 1-3, as diffusers' UniPCMultistepScheduler runs them
MAX_CARRY = 1 + MAX_SOLVER_ORDER  # the most history tensors a sampler carries (a step kind declares them all)


@dataclass(frozen=True)
class SamplerPlan:
    """Per-request schedule: `timesteps[i]` feeds the denoiser at step i, `coeffs[i]` the update."""

    timesteps: torch.Tensor  # [N], the dtype diffusers uses
    coeffs: torch.Tensor  # [N, num_coeffs] float32


class _PlannedSampler(abc.ABC):
    """Plans are read-only tensors, memoized per (step count, start): every request with N steps shares one.

    `start` > 0 is a schedule entered part-way (video-to-video's `strength`, `start_step`): the plan
    of steps start..N-1 of the N-step schedule, as a diffusers scheduler runs them when the pipeline
    hands it `timesteps[start:]`; a multistep sampler then starts its history afresh there."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, int], SamplerPlan] = {}

    def plan(self, num_steps: int, start: int = 0) -> SamplerPlan:
        if not 0 <= start < num_steps:
            raise ValueError(f"a schedule of {num_steps} steps cannot start at step {start}")
        if (num_steps, start) not in self._plans:
            self._plans[num_steps, start] = self._plan(num_steps, start)
        return self._plans[num_steps, start]

    @abc.abstractmethod
    def _plan(self, num_steps: int, start: int) -> SamplerPlan: ...


def start_step(num_steps: int, strength: float) -> int:
    """The steps a `strength` skips, as diffusers' img2img / video2video `get_timesteps`: the last
    int(N * strength) steps run."""
    return max(num_steps - min(int(num_steps * strength), num_steps), 0)


class FlowEulerSampler(_PlannedSampler):
    """diffusers FlowMatchEulerDiscreteScheduler as (sigma, dt) per step; carries no history."""

    history = 0
    num_carry = 0  # tensors of history a step takes and returns ("carry_i")
    draws_noise = False  # whether a step takes fresh noise (its "fresh_noise" input)

    def __init__(self, config: dict):
        super().__init__()
        self._scheduler = FlowMatchEulerDiscreteScheduler(**config)  # schedule only; never stepped

    def _plan(self, num_steps: int, start: int) -> SamplerPlan:
        self._scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = self._scheduler.sigmas.to(torch.float32)
        coeffs = torch.stack([sigmas[:-1], sigmas[1:] - sigmas[:-1]], dim=1)
        return SamplerPlan(self._scheduler.timesteps[start:].clone(), coeffs[start:].clone())  # each row stands alone

    def initial_carry(self, sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    @staticmethod
    def update(sample, model_output, carry, coeffs):
        dt = _per_row(coeffs[:, 1], sample)
        return sample + dt * model_output.to(sample.dtype), ()

    @staticmethod
    def denoised(sample, new_sample, new_carry, coeffs, noise=None):
        """The step's x0 = x - sigma * v from its input and output, v = (x' - x) / dt (`coeffs`: the step's host row)."""
        sigma, dt = float(coeffs[0]), float(coeffs[1])
        return sample - sigma * (new_sample - sample) / dt


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                    max_shift: float = 1.15) -> float:
    """The schedule shift `mu` for an image of `image_seq_len` tokens: linear in the token count, from
    `base_shift` at `base_seq_len` to `max_shift` at `max_seq_len`. Equals diffusers'
    `diffusers.pipelines.flux.pipeline_flux.calculate_shift` (0.42.1; tests/test_samplers.py compares
    them), written out here so that importing the samplers loads no diffusers pipeline module."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


class ImageFlowEulerSampler(FlowEulerSampler):
    """The flow-matching Euler schedule of diffusers' image pipelines (FluxPipeline, QwenImagePipeline):
    sigmas linspace(1, 1/N, N) handed to the scheduler with `mu` from the image's token count
    (`calculate_shift`, used when the config has dynamic shifting). The update is FlowEulerSampler's;
    plans are memoized per (steps, image tokens), so requests of one shape share them."""

    def __init__(self, config: dict):
        super().__init__(config)
        self._image_plans: dict[tuple[int, int], SamplerPlan] = {}

    def plan(self, num_steps: int, image_tokens: int) -> SamplerPlan:
        key = (num_steps, image_tokens)
        if key not in self._image_plans:
            self._image_plans[key] = self._image_plan(*key)
        return self._image_plans[key]

    def _image_plan(self, num_steps: int, image_tokens: int) -> SamplerPlan:
        config = self._scheduler.config
        mu = calculate_shift(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))  # fmt: skip
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        self._scheduler.set_timesteps(num_steps, device="cpu", sigmas=sigmas, mu=mu)
        sigmas = self._scheduler.sigmas.to(torch.float32)
        coeffs = torch.stack([sigmas[:-1], sigmas[1:] - sigmas[:-1]], dim=1)
        return SamplerPlan(self._scheduler.timesteps.clone(), coeffs)


class FewStepSampler(_PlannedSampler):
    """A distilled recipe's fixed timestep list, as (sigma, sigma_next) per step; carries no history.

    sigma = shift * s / (1 + (shift - 1) * s) with s = t / 1000, the model sees sigma * 1000 (LightX2V's
    schedule; with shift 1 it is FastVideo's scheduler-space list), and the last step lands on sigma 0,
    where both updates return x0."""

    history = 0
    num_carry = 0

    def __init__(self, spec: SamplerSpec):
        super().__init__()
        self.listed = spec.timestep_list
        self.shift = float(spec.config["flow_shift"])
        self.draws_noise = spec.draws_noise
        self.final_draw = False  # the last step lands on sigma 0: x0, no noise (the recipes draw none)

    def _plan(self, num_steps: int, start: int) -> SamplerPlan:
        if start:
            raise ValueError("a distilled recipe runs its listed timesteps from the first; it cannot start part-way")
        if num_steps != len(self.listed):
            raise ValueError(f"this sampler runs its {len(self.listed)} listed timesteps, not {num_steps} steps")
        s = torch.tensor(self.listed, dtype=torch.float64) / TRAIN_TIMESTEPS
        sigmas = (self.shift * s / (1 + (self.shift - 1) * s)).to(torch.float32)
        following = torch.cat([sigmas[1:], sigmas.new_zeros(1)])
        return SamplerPlan(sigmas * TRAIN_TIMESTEPS, torch.stack([sigmas, following], dim=1))

    def initial_carry(self, sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    def update(self, sample, model_output, carry, coeffs, noise=None):
        sigma, following = _per_row(coeffs[:, 0], sample), _per_row(coeffs[:, 1], sample)
        velocity = model_output.to(sample.dtype)
        if not self.draws_noise:
            return sample + (following - sigma) * velocity, ()
        x0 = sample - sigma * velocity
        return (1 - following) * x0 + following * noise, ()

    def denoised(self, sample, new_sample, new_carry, coeffs, noise=None):
        """The step's x0 from its input and output: the Euler step's x - sigma * v, or the re-noising
        update solved for x0 with the noise it took (`coeffs`: the step's host row)."""
        sigma, following = float(coeffs[0]), float(coeffs[1])
        if not self.draws_noise:
            return sample - sigma * (new_sample - sample) / (following - sigma)
        return (new_sample - following * noise) / (1 - following)


class FlowSdeSampler:
    """Flow-GRPO's SDE form of the flow-matching Euler step (its `sde_step_with_logprob`), for rollouts:
    the ODE step plus Gaussian noise at a declared noise level, and the log-probability of the
    transition it took. On diffusers' FlowMatchEulerDiscreteScheduler sigmas at the card's shift, per step

        std  = noise_level * sqrt(sigma / (1 - sigma'))     (sigma' = the second sigma where sigma = 1)
        mean = x * (1 + std^2 / (2 sigma) * dt) + v * (1 + std^2 (1 - sigma) / (2 sigma)) * dt,  dt = sigma_next - sigma
        x'   = mean + std * sqrt(-dt) * noise

    and log p(x' | x) is the Gaussian density of x' around the mean, averaged over the elements. The
    row is [sigma, a, b, c] with mean = a x + b v and x' = mean + c noise; the noise is fresh at every
    step, the last included. Plans are memoized per (steps, noise level)."""

    history = 0
    num_carry = 0
    draws_noise = True
    final_draw = True  # the last step adds noise too (sigma_next = 0 still leaves dt < 0)
    log_probs = True  # the step also returns "log_prob" [B]

    def __init__(self, flow_shift: float):
        self._scheduler = FlowMatchEulerDiscreteScheduler(shift=flow_shift)  # schedule only; never stepped
        self._plans: dict[tuple[int, float], SamplerPlan] = {}

    def plan(self, num_steps: int, noise_level: float) -> SamplerPlan:
        key = (num_steps, float(noise_level))
        if key not in self._plans:
            self._plans[key] = self._plan(*key)
        return self._plans[key]

    def _plan(self, num_steps: int, noise_level: float) -> SamplerPlan:
        self._scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = self._scheduler.sigmas.to(torch.float32)
        sigma, following = sigmas[:-1], sigmas[1:]
        dt = following - sigma
        second = sigmas[1] if num_steps > 1 else sigmas[0].new_tensor(0.0)
        std = torch.sqrt(sigma / (1 - torch.where(sigma == 1, second, sigma))) * noise_level
        a = 1 + std**2 / (2 * sigma) * dt
        b = (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        c = std * torch.sqrt(-1 * dt)
        return SamplerPlan(self._scheduler.timesteps.clone(), torch.stack([sigma, a, b, c], dim=1))

    def initial_carry(self, sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    @staticmethod
    def update(sample, model_output, carry, coeffs, noise=None):
        a, b, c = (_per_row(coeffs[:, j], sample) for j in (1, 2, 3))
        mean = a * sample + b * model_output.to(sample.dtype)
        following = mean + c * noise
        log_prob = -((following - mean) ** 2) / (2 * c**2) - torch.log(c) - HALF_LOG_TWO_PI
        return following, (), log_prob.mean(dim=tuple(range(1, log_prob.dim())))


HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


class UniPCSampler(_PlannedSampler):
    """diffusers UniPCMultistepScheduler (flow sigmas, predict_x0) with coefficients planned ahead.

    Coefficient row layout for K = solver_order history slots of past x0 (h_0 newest):
      [sigma, c_x, c_last, c_h[0..K), c_x0, p_x, p_x0, p_h[0..K)]
    corrected = c_x*x + c_last*x_last + sum_k c_h[k]*h_k + c_x0*x0
    next      = p_x*corrected + p_x0*x0 + sum_k p_h[k]*h_k
    and the history shifts to (x0, h_0, ..., h_{K-2}).
    """

    def __init__(self, config: dict):
        super().__init__()
        self._scheduler = UniPCMultistepScheduler(**config)
        cfg = self._scheduler.config
        if not (cfg.use_flow_sigmas and cfg.predict_x0 and cfg.prediction_type == "flow_prediction"):
            raise ValueError(
                "sampler 'unipc' supports use_flow_sigmas=True, predict_x0=True, prediction_type='flow_prediction' "
                f"(got {cfg.use_flow_sigmas}, {cfg.predict_x0}, {cfg.prediction_type!r})"
            )
        if cfg.solver_type not in ("bh1", "bh2") or cfg.solver_p is not None or cfg.thresholding:
            raise ValueError("sampler 'unipc' supports solver_type bh1/bh2 without solver_p or thresholding")
        if not 1 <= cfg.solver_order <= MAX_SOLVER_ORDER:
            raise ValueError(f"sampler 'unipc': solver_order={cfg.solver_order} must be in [1, {MAX_SOLVER_ORDER}]")
        self.order = cfg.solver_order
        self.draws_noise = False
        self.history = self.order  # diffusers keeps solver_order past x0 predictions
        self.num_carry = 1 + self.history  # the last sample and the x0 history

    def initial_carry(self, sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x_last, h_0, ..., h_{K-1}); zeros weighted by zero coefficients until filled."""
        return tuple(torch.zeros_like(sample) for _ in range(1 + self.history))

    def _plan(self, num_steps: int, start: int) -> SamplerPlan:
        self._scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = self._scheduler.sigmas.to(torch.float32)
        cfg = self._scheduler.config
        # From `start` the scheduler has no last sample and no history yet: no corrector at the first
        # step run, and the order climbs from 1 again (diffusers' lower_order_nums starts at 0).
        rows, this_order, lower_order_nums = [], 0, 0
        for i in range(start, num_steps):
            corrector = None
            if i > start and (i - 1) not in cfg.disable_corrector:
                corrector = self._corrector(sigmas, i, this_order)
            if cfg.lower_order_final:
                this_order = min(cfg.solver_order, num_steps - i)
            else:
                this_order = cfg.solver_order
            this_order = min(this_order, lower_order_nums + 1)
            predictor = self._predictor(sigmas, i, this_order)
            lower_order_nums = min(lower_order_nums + 1, cfg.solver_order)
            rows.append(self._row(sigmas[i], corrector, predictor))
        return SamplerPlan(self._scheduler.timesteps[start:].clone(), torch.tensor(rows, dtype=torch.float32))

    # -- coefficient planning (host, float32 scalars as diffusers computes them) -------------------

    def _lambda(self, sigma: torch.Tensor) -> torch.Tensor:
        alpha = 1 - sigma
        return torch.log(alpha) - torch.log(sigma)

    def _solver_terms(self, sigmas, t_idx: int, s0_idx: int, hist_idx: list[int], order: int):
        """The shared UniPC algebra: sigma ratio, h*phi_1, B(h), the r_k and the rhos system."""
        sigma_t, sigma_s0 = sigmas[t_idx], sigmas[s0_idx]
        alpha_t = 1 - sigma_t
        lambda_s0 = self._lambda(sigma_s0)
        h = self._lambda(sigma_t) - lambda_s0
        rks = [(self._lambda(sigmas[si]) - lambda_s0) / h for si in hist_idx[: order - 1]]
        rks_t = torch.stack(rks + [torch.ones(())])
        hh = -h
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        b_h = hh if self._scheduler.config.solver_type == "bh1" else torch.expm1(hh)
        R, b, factorial_i = [], [], 1
        for k in range(1, order + 1):
            R.append(torch.pow(rks_t, k - 1))
            b.append(h_phi_k * factorial_i / b_h)
            factorial_i *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_i
        return sigma_t / sigma_s0, alpha_t, h_phi_1, b_h, rks, torch.stack(R), torch.stack(b)

    def _corrector(self, sigmas, i: int, order: int) -> dict:
        """UniC at step i: corrects x_i using x_{i-1} (x_last) and x0 history; `order` of step i-1."""
        ratio, alpha_t, h_phi_1, b_h, rks, R, b = self._solver_terms(
            sigmas, i, i - 1, [i - 1 - k for k in range(1, order)], order
        )
        rhos = torch.full((1,), 0.5) if order == 1 else torch.linalg.solve(R, b)
        scale = alpha_t * b_h
        # D1_k = (h_k - h_0) / r_k and D1_t = x0 - h_0, expanded into per-tensor weights.
        h = [0.0] * self.history
        h[0] = float(-alpha_t * h_phi_1 + scale * rhos[-1] + sum(scale * rhos[k] / rk for k, rk in enumerate(rks)))
        for k, rk in enumerate(rks):
            h[k + 1] = float(-scale * rhos[k] / rk)
        return {"x": 0.0, "last": float(ratio), "h": h, "x0": float(-scale * rhos[-1])}

    def _predictor(self, sigmas, i: int, order: int) -> dict:
        """UniP from sigma_i to sigma_{i+1}; its history terms are x0_i (weight x0) and h_k = x0_{i-1-k}."""
        if float(sigmas[i + 1]) == 0.0:  # final sigma: alpha=1, sigma=0, the update returns x0 exactly
            return {"x": 0.0, "x0": 1.0, "h": [0.0] * self.history}
        ratio, alpha_t, h_phi_1, b_h, rks, R, b = self._solver_terms(
            sigmas, i + 1, i, [i - k for k in range(1, order)], order
        )
        if order == 1:
            rhos = torch.zeros(0)
        elif order == 2:
            rhos = torch.full((1,), 0.5)
        else:
            rhos = torch.linalg.solve(R[:-1, :-1], b[:-1])
        scale = alpha_t * b_h
        x0 = float(-alpha_t * h_phi_1 + sum(scale * rhos[k] / rk for k, rk in enumerate(rks)))
        h = [0.0] * self.history
        for k, rk in enumerate(rks):
            h[k] = float(-scale * rhos[k] / rk)
        return {"x": float(ratio), "x0": x0, "h": h}

    def _row(self, sigma, corrector: dict | None, predictor: dict) -> list[float]:
        if corrector is None:  # no corrector: corrected = x
            corrector = {"x": 1.0, "last": 0.0, "h": [0.0] * self.history, "x0": 0.0}
        return [
            float(sigma),
            corrector["x"], corrector["last"], *corrector["h"], corrector["x0"],
            predictor["x"], predictor["x0"], *predictor["h"],
        ]  # fmt: skip

    # -- the in-graph update ------------------------------------------------------------------------

    def update(self, sample, model_output, carry, coeffs):
        K = self.history
        x_last, hist = carry[0], carry[1:]
        col = lambda j: _per_row(coeffs[:, j], sample)  # noqa: E731
        x0 = sample - col(0) * model_output.to(sample.dtype)
        corrected = col(1) * sample + col(2) * x_last + col(3 + K) * x0
        for k in range(K):
            corrected = corrected + col(3 + k) * hist[k]
        new_hist = (x0, *hist[:-1]) if K else ()
        nxt = col(4 + K) * corrected + col(5 + K) * x0
        for k in range(K):
            nxt = nxt + col(6 + K + k) * hist[k]
        return nxt, (corrected, *new_hist)

    @staticmethod
    def denoised(sample, new_sample, new_carry, coeffs, noise=None):
        """The step's x0: the newest entry of the history the step returned (an output it computes anyway)."""
        return new_carry[1]


def _per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [B] coefficient broadcast over a [B, ...] tensor."""
    return values.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def build_sampler(spec: SamplerSpec) -> FlowEulerSampler | FewStepSampler | UniPCSampler:
    if spec.name == "flow_euler":
        return FlowEulerSampler(spec.config)
    if spec.name == "flow_euler_image":
        return ImageFlowEulerSampler(spec.config)
    if spec.timestep_list is not None:
        return FewStepSampler(spec)
    return UniPCSampler(spec.config)


def num_coeffs(sampler) -> int:
    """Width of a coefficient row (used to validate saved states)."""
    if isinstance(sampler, FlowSdeSampler):
        return 4
    return 2 if isinstance(sampler, (FlowEulerSampler, FewStepSampler)) else 6 + 2 * sampler.history


