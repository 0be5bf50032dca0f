"""TeaCache (Liu et al., github.com/ali-vilab/TeaCache) as a step-caching method: planned before the
run on Wan, decided from each step's own data on FLUX.

TeaCache skips the transformer blocks at a step when the model's output is predicted to change
little since the last full step. Its predictor for Wan is the relative L1 change of the timestep
embedding between consecutive steps, rescaled by a polynomial fitted once per model and accumulated
until it reaches `threshold`. The embedding depends on the timestep and the condition embedder's
weights only, so every decision of a request is known before its first step: the policy runs the
condition embedder once per timestep of the schedule when it is built, and decides between steps
from those numbers without reading the device again.

The decision transcribes TeaCache4Wan2.1/teacache_generate.py (`teacache_forward`, with the
per-model settings its `generate` installs):

    signal       use_ret_steps: the timestep projection (diffusers' `timestep_proj`, Wan's `e0`);
                 else the timestep embedding (`temb`, Wan's `e`)
    always run   use_ret_steps: the first 5 steps; else the first and the last step (accumulator reset)
    otherwise    acc += poly(mean|s_i - s_{i-1}| / mean|s_{i-1}|); reuse if acc < threshold,
                 else compute and reset acc to 0

TeaCache keeps an even (cond) and an odd (uncond) accumulator, counting denoiser calls; both see
the same timesteps and decide alike, so one decision per step serves both CFG branches while the
kept residual is per branch. Its script always runs both branches; here a request without CFG
follows the same per-step rule.

On FLUX the signal is the first block's modulated input of the image tokens (`signal =
"modulated_input"`, what the family's sections declare), which depends on the latents: the decision
transcribes TeaCache4FLUX/teacache_flux.py (`teacache_forward`) and is taken between two launches of
the step (fvgraph/caching/tea_probe_steps.py):

    always run   the first and the last step (accumulator reset)
    otherwise    acc += poly(mean|m_i - m_{i-1}| / mean|m_{i-1}|), m_{i-1} the previous step's signal
                 whether that step computed or not; reuse if acc < threshold, else compute and reset

The loop fills `signal` from its sections when it checks a request (`for_sections`), so a saved
state names the state type it resumes as.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from fvgraph.caching.residual_steps import ResidualState
from fvgraph.caching.settings import CacheSettings, PolicyContext, ScheduledPolicy
from fvgraph.caching.tea_probe_steps import TeaProbeState

Coefficient = Annotated[float, Field(allow_inf_nan=False)]
RETAINED_STEPS = 5  # use_ret_steps: TeaCache4Wan2.1's ret_steps = 5 * 2 denoiser calls
Signal = Literal["timestep", "modulated_input"]


class TeaCacheSettings(CacheSettings):
    """TeaCache4Wan2.1's settings (TeaCache4FLUX's are a subset): `teacache_thresh` / `rel_l1_thresh`
    as `threshold`, and `use_ret_steps`."""

    method: Literal["teacache"] = "teacache"
    memo_keys: ClassVar[tuple[str, ...]] = ("acc",)  # what its policy's start() returns
    threshold: float = Field(0.2, ge=0, allow_inf_nan=False, description="Accumulated rescaled change up to which steps reuse "
                             "(TeaCache4Wan2.1's default; its README pairs 0.05-0.08 with 1.5-2x on Wan 2.1 1.3B).")  # fmt: skip
    use_ret_steps: bool = Field(False, description="Retention steps: the first 5 steps always compute, the signal is the "
                                "timestep projection and no final step is forced.")  # fmt: skip
    coefficients: tuple[Coefficient, ...] | None = Field(
        None, min_length=1, description="The rescaling polynomial, highest power first; default: the card's for the signal."
    )

    signal: Signal | None = Field(
        None, description="What the change is measured on: 'timestep' (Wan's timestep embedding, planned before the run) or "
        "'modulated_input' (the first block's modulated input, measured at each step: FLUX); default: the denoiser family's.",
    )  # fmt: skip

    @property
    def state_type(self) -> type:  # type: ignore[override]  # the StepCachingState, by signal
        return TeaProbeState if self.signal == "modulated_input" else ResidualState

    @property
    def coefficient_variant(self) -> str:
        """The field of the card's `recipe.teacache_coefficients` these settings read."""
        if self.signal == "modulated_input":
            return "modulated_input"
        return "timestep_projection" if self.use_ret_steps else "timestep_embedding"

    def for_sections(self, sections: Any) -> TeaCacheSettings:
        family = sections.teacache_signal
        if self.signal not in (None, family):
            raise ValueError(f"cache.signal: {self.signal!r} is not what this denoiser's TeaCache reads ({family!r}); leave it out")
        if family == "modulated_input" and self.use_ret_steps:
            raise ValueError("cache.use_ret_steps: retention steps are TeaCache4Wan2.1's; TeaCache on the first block's "
                             "modulated input always computes the first and the last step")  # fmt: skip
        return self if self.signal == family else self.model_copy(update={"signal": family})

    def check_card(self, card: Any) -> tuple[str, str] | None:  # a ModelCard (fvgraph/card.py sits above)
        published = card.recipe.teacache_coefficients
        if self.coefficients is None and (published is None or getattr(published, self.coefficient_variant) is None):
            return ("cache.coefficients", f"card {card.card_id!r} declares no TeaCache coefficients for its signal "
                                          f"(recipe.teacache_coefficients.{self.coefficient_variant}); pass the polynomial "
                                          "fitted for these weights")  # fmt: skip
        return None

    def policy(self, num_inference_steps: int, context: PolicyContext | None = None) -> TeaCache | ModulatedInputTeaCache:
        if context is None:
            raise ValueError("TeaCache reads the request's timesteps, the card and the denoiser: build it with a PolicyContext")
        if self.signal == "modulated_input":
            return ModulatedInputTeaCache(self, num_inference_steps, context)
        return TeaCache(self, num_inference_steps, context)


def timestep_signal(transformer: torch.nn.Module, timestep: torch.Tensor, embed_dtype: torch.dtype, projection: bool) -> torch.Tensor:
    """TeaCache's signal for one denoiser call at `timestep` ([1]): what WanTransformer3DModel's own
    condition embedder returns as `timestep_proj` (projection) or `temb`. Its text input only sets
    the dtype the embedding is cast to (`type_as`), so one zero token stands in for the text."""
    embedder = transformer.condition_embedder
    text_dim = embedder.text_embedder.linear_1.in_features
    zero_text = torch.zeros(1, 1, text_dim, dtype=embed_dtype, device=timestep.device)
    temb, timestep_proj, _, _ = embedder(timestep, zero_text)
    return timestep_proj if projection else temb


class TeaCache(ScheduledPolicy):
    """One request's TeaCache decisions on the timestep signal; `memo` holds the accumulated rescaled distance."""

    def __init__(self, settings: TeaCacheSettings, num_inference_steps: int, context: PolicyContext):
        coefficients = settings.coefficients or getattr(context.card.recipe.teacache_coefficients, settings.coefficient_variant)
        self.threshold = settings.threshold
        self.first = RETAINED_STEPS if settings.use_ret_steps else 1
        self.last = num_inference_steps if settings.use_ret_steps else num_inference_steps - 1
        self.rescaled = [0.0] + np.poly1d(coefficients)(self._relative_l1(settings, context)).tolist()

    @staticmethod
    def _relative_l1(settings: TeaCacheSettings, context: PolicyContext) -> list[float]:
        """mean|s_i - s_{i-1}| / mean|s_{i-1}| for i >= 1, computed as TeaCache computes it at each
        call (one timestep at a time, in the embedder's dtype, on the engine's device). This runs when
        the request's policy is built, i.e. when it is initialised (and again after a resume), before
        any of its steps is queued: reading these N-1 numbers back once there is what lets every
        later decision be host arithmetic that needs no graph break and no host sync between steps."""
        device = next(context.transformer.parameters()).device
        with torch.no_grad():
            signals = [timestep_signal(context.transformer, t.to(device), context.embed_dtype, settings.use_ret_steps)
                       for t in context.timesteps.split(1)]  # fmt: skip
            ratios = [(s - p).abs().mean() / p.abs().mean() for p, s in zip(signals, signals[1:])]
            return torch.stack(ratios).float().tolist() if ratios else []

    def start(self) -> dict[str, float]:
        return {"acc": 0.0}

    def decide(self, memo: dict[str, float], step_index: int, has_kept: bool) -> tuple[bool, dict[str, float]]:
        """(compute, memo after this step): True when step `step_index` must run the blocks."""
        if step_index < self.first or step_index >= self.last:
            return True, self.start()
        acc = memo["acc"] + self.rescaled[step_index]
        if has_kept and acc < self.threshold:
            return False, {"acc": acc}
        return True, self.start()


class ModulatedInputTeaCache:
    """One request's TeaCache decisions on the first block's modulated input (a BranchPolicy), from
    the probe launch's host row; `memo` holds the accumulated rescaled distance."""

    def __init__(self, settings: TeaCacheSettings, num_inference_steps: int, context: PolicyContext):
        self.rescale = np.poly1d(settings.coefficients or context.card.recipe.teacache_coefficients.modulated_input)
        self.threshold = settings.threshold
        self.last = num_inference_steps - 1
        self.sections = context.sections

    def zero_signal(self, latents: torch.Tensor) -> torch.Tensor:
        """The previous modulated input before the first probe (step 0 computes whatever it measures)."""
        return torch.zeros(self.sections.token_shape(latents), dtype=self.sections.token_dtype, device=latents.device)

    def start(self) -> dict[str, float]:
        return {"acc": 0.0}

    def decide_branches(self, memo: dict[str, float], step_index: int, change: torch.Tensor,
                        has_kept: bool) -> tuple[tuple[bool, ...], dict[str, float]]:  # fmt: skip
        """One decision for the step, from `change` [1, 2] on the host (mean |m - m_prev|, mean |m_prev|),
        divided in its own dtype as TeaCache4FLUX divides on the device before `.item()`."""
        if step_index == 0 or step_index >= self.last:
            return (True,), self.start()
        acc = memo["acc"] + float(self.rescale((change[0, 0] / change[0, 1]).item()))
        if has_kept and acc < self.threshold:
            return (False,), {"acc": acc}
        return (True,), self.start()
