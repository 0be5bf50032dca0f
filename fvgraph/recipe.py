"""The recipe contract: what produced a card's weights, and so what they assume when they serve.

A deployable model is a (recipe, runtime) pair. A base model takes a range of step counts, classifier-free
guidance at any scale, and every step-caching method. A distilled one was trained for one thing:

- step-distilled: the exact timesteps it was distilled on (LightX2V's `denoising_step_list`, FastVideo's
  `dmd_denoising_steps`); any other count walks a trajectory the student never saw;
- CFG-distilled: guidance is baked into one branch; a guidance scale or a negative prompt would be
  ignored by the weights, so it is refused instead of silently dropped;
- neither admits step caching: each of a few steps moves far along the trajectory, so a step-skip
  cache reuses a prediction that no longer holds (LightX2V's distill schedulers refuse feature caching
  for the same reason).

`RecipeSpec.violation` is where a request meets the contract: Request.resolve turns what it returns
into a RequestRejected naming the field, before any weight runs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
RecipeMethod = Literal["base", "step_distilled", "cfg_distilled", "step_cfg_distilled"]

# Samplers on the recipe's own timestep list (fvgraph/loops/samplers.py): deterministic flow Euler, and the
# stochastic few-step update of DMD / self-forcing students (predict x0, re-noise to the next timestep).
STEP_LIST_SAMPLERS = ("few_step_euler", "few_step_renoise")
TRAIN_TIMESTEPS = 1000


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplerSpec(_Spec):
    """The sampler the recipe assumes. For 'unipc', 'flow_euler' and 'flow_euler_image' (the flow-matching
    Euler schedule as diffusers' FLUX and Qwen-Image pipelines plan it: sigmas from 1 to 1/N, shifted by
    the image's token count), `config` is the diffusers scheduler config it mirrors; for the step-list samplers it is {"timesteps": [...], "flow_shift": s}: the
    recipe's denoising step list in [0, 1000] (descending), each mapped to sigma = shift(t / 1000) as
    LightX2V's WanStepDistillScheduler does (shift 1: sigma = t / 1000, FastVideo's scheduler space)."""

    name: Literal["unipc", "flow_euler", "flow_euler_image", "few_step_euler", "few_step_renoise"]
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _step_list(self) -> SamplerSpec:
        if self.name not in STEP_LIST_SAMPLERS:
            return self
        if set(self.config) != {"timesteps", "flow_shift"}:
            raise ValueError(f"sampler {self.name!r}: config takes exactly 'timesteps' and 'flow_shift', got {sorted(self.config)}")
        steps = [float(t) for t in self.config["timesteps"]]
        if not steps or any(not 0 < t <= TRAIN_TIMESTEPS for t in steps) or any(a <= b for a, b in zip(steps, steps[1:])):
            raise ValueError(f"sampler {self.name!r}: timesteps={steps} must be strictly descending within (0, {TRAIN_TIMESTEPS}]")
        if not float(self.config["flow_shift"]) > 0:
            raise ValueError(f"sampler {self.name!r}: flow_shift={self.config['flow_shift']} must be > 0")
        return self

    @property
    def timestep_list(self) -> tuple[float, ...] | None:
        """The recipe's fixed denoising step list, or None for a sampler planned for any step count."""
        return tuple(float(t) for t in self.config["timesteps"]) if self.name in STEP_LIST_SAMPLERS else None

    @property
    def draws_noise(self) -> bool:
        """Whether each step takes fresh noise from the request's generator."""
        return self.name == "few_step_renoise"


class TeaCacheCoefficients(_Spec):
    """TeaCache's published polynomial for a model (highest power first, as numpy.poly1d takes it),
    one per signal: it maps the relative L1 change of that signal to the change of the model output."""

    timestep_embedding: tuple[float, ...] | None = Field(
        default=None, min_length=1, description="For Wan's timestep embedding (use_ret_steps=False)."
    )
    timestep_projection: tuple[float, ...] | None = Field(
        default=None, min_length=1, description="For Wan's timestep projection (use_ret_steps=True)."
    )
    modulated_input: tuple[float, ...] | None = Field(
        default=None, min_length=1, description="For the first block's modulated input of the image tokens (FLUX)."
    )

    @model_validator(mode="after")
    def _some_signal(self) -> TeaCacheCoefficients:
        if all(getattr(self, name) is None for name in type(self).model_fields):
            raise ValueError(f"teacache_coefficients: give the polynomial of at least one signal ({', '.join(type(self).model_fields)})")
        return self


class RecipeAdapter(_Spec):
    """The LoRA a distill is published as (LightX2V's Wan2.1-Distill-Loras), fused into the base weights
    at `scale`. The engine reads it from the local file passed as `loras={name: path}`; a card whose
    checkpoint already holds the fused weights (`in_checkpoint`) needs no file."""

    name: str = Field(description="The name `loras=` / --lora passes the local file under.")
    source: str = Field(description="Where the file is published, e.g. 'lightx2v/Wan2.1-Distill-Loras'.")
    weight_name: str = Field(description="The file's name there.")
    scale: float = Field(default=1.0, description="The strength the recipe fuses it at (LightX2V's lora_configs strength).")
    in_checkpoint: bool = Field(default=False, description="The checkpoint's weights already have it fused (a merged release).")


class RecipeParents(_Spec):
    """What a distilled recipe was made from: the base card and, for a LoRA distill, the adapter (of
    a two-expert card, one per expert: LightX2V's Wan 2.2 A14B distill is a high-noise and a low-noise file)."""

    base_card: str
    adapter: RecipeAdapter | None = Field(default=None, description="The LoRA of `transformer` (the high-noise or only denoiser).")
    adapter_2: RecipeAdapter | None = Field(default=None, description="The LoRA of `transformer_2` (a two-expert card's low-noise denoiser).")

    @model_validator(mode="after")
    def _two_names(self) -> RecipeParents:
        if self.adapter_2 is not None and (self.adapter is None or self.adapter.name == self.adapter_2.name):
            raise ValueError("parents: adapter_2 (the low-noise expert's LoRA) comes with an adapter of another name")
        return self


class RecipeSpec(_Spec):
    """What produced the weights, and therefore what the weights assume at serve time."""

    method: RecipeMethod = Field(description="'base' for a pretrained model, else which distillation it went through.")
    name: str = Field(default="base", description="The recipe's name in messages and provenance, e.g. 'lightx2v-4step'.")
    parents: RecipeParents | None = Field(default=None, description="The base card (and adapter) a distilled recipe builds on.")
    assumes_loop: str = Field(description="The loop id these weights require.")
    sampler: SamplerSpec
    default_steps: int = Field(gt=0)
    allowed_steps: tuple[int, int] = Field(description="Inclusive (min, max) num_inference_steps.")
    precision: Precision = "bf16"
    assumes_precision: Precision | None = Field(
        default=None, description="The precision the recipe was made and checked in (None: `precision`); a run in "
        "another (dtype=) is reported in the result's provenance.",
    )
    default_guidance_scale: float = 5.0
    cfg_scale: Literal["guidance_scale", "true_cfg_scale"] = Field(
        default="guidance_scale",
        description="The request field whose value > 1 turns classifier-free guidance on: guidance_scale (Wan), or "
        "true_cfg_scale with a negative prompt (FLUX, Qwen-Image: there guidance_scale is the denoiser's embedded "
        "guidance input where its weights take one, as in diffusers' pipelines).",
    )
    default_true_cfg_scale: float = Field(
        default=1.0, ge=0.0,
        description="With cfg_scale='true_cfg_scale': the scale a request with a negative prompt and no true_cfg_scale "
        "runs (the pipeline's default: FluxPipeline 1.0, QwenImagePipeline 4.0); one without a negative prompt runs none.",
    )
    boundary_ratio: float | None = Field(
        default=None, gt=0.0, lt=1.0,
        description="Two-expert models: timesteps >= this x the training timesteps run `transformer` (high "
        "noise), the rest `transformer_2` (as diffusers' WanPipeline boundary_ratio).",
    )
    default_guidance_scale_2: float | None = Field(default=None, description="The low-noise expert's guidance.")
    teacache_coefficients: TeaCacheCoefficients | None = Field(
        default=None, description="TeaCache's rescaling polynomials for these weights (docs/step_caching.md)."
    )
    step_caching: tuple[str, ...] | None = Field(
        default=None, description="The step-caching methods the weights admit (None: every method; () for a distill)."
    )

    @model_validator(mode="after")
    def _contract(self) -> RecipeSpec:
        lo, hi = self.allowed_steps
        if not 1 <= lo <= hi:
            raise ValueError(f"allowed_steps={self.allowed_steps} must satisfy 1 <= min <= max")
        if not lo <= self.default_steps <= hi:
            raise ValueError(f"default_steps={self.default_steps} is outside allowed_steps={self.allowed_steps}")
        steps = self.sampler.timestep_list
        if self.step_distilled:
            if steps is None or self.allowed_steps != (len(steps), len(steps)) or self.default_steps != len(steps):
                raise ValueError(f"recipe {self.name!r} ({self.method}): a step-distilled recipe runs a step-list sampler "
                                 f"({', '.join(('few_step_euler', 'few_step_renoise'))}) and allows exactly its steps")
            if self.step_caching != ():
                raise ValueError(f"recipe {self.name!r} ({self.method}): step_caching must be () (a distill admits no step caching)")
        elif steps is not None and self.allowed_steps != (len(steps), len(steps)):
            raise ValueError(f"recipe {self.name!r}: sampler {self.sampler.name!r} runs its {len(steps)} listed timesteps; "
                             f"allowed_steps={self.allowed_steps} must be ({len(steps)}, {len(steps)})")
        if self.cfg_distilled and (self.default_guidance_scale != 1.0 or self.default_guidance_scale_2 not in (None, 1.0)):
            raise ValueError(f"recipe {self.name!r} ({self.method}): default_guidance_scale must be 1.0 "
                             "(and default_guidance_scale_2 1.0 or unset): guidance is distilled in")  # fmt: skip
        if (self.method == "base") != (self.parents is None):
            raise ValueError(f"recipe {self.name!r}: a base recipe has no parents and a distilled one names its base card")
        return self

    @property
    def step_distilled(self) -> bool:
        return self.method in ("step_distilled", "step_cfg_distilled")

    @property
    def cfg_distilled(self) -> bool:
        return self.method in ("cfg_distilled", "step_cfg_distilled")

    def admits_caching(self, method: str) -> bool:
        return self.step_caching is None or method in self.step_caching

    def violation(self, card_id: str, request: Any) -> tuple[str, str] | None:
        """(field, message) for the first request value the recipe does not take, else None. `request`
        is a Request as given (None where the card's default applies)."""
        who = f"card {card_id!r} runs recipe {self.name!r} ({self.method})"
        steps = self.sampler.timestep_list
        lo, hi = self.allowed_steps
        n = request.num_inference_steps
        if n is not None and steps is not None and n != len(steps):
            return "num_inference_steps", (f"{n}: {who}, distilled on the {len(steps)} timesteps [{', '.join(f'{t:g}' for t in steps)}]; "
                                           f"it takes exactly {len(steps)} steps (or leave num_inference_steps unset)")  # fmt: skip
        if n is not None and not lo <= n <= hi:
            return "num_inference_steps", (f"{n} is outside [{lo}, {hi}], the range {who} allows "
                                           f"(sampler {self.sampler.name!r})")  # fmt: skip
        if self.cfg_distilled:
            why = f"{who}: guidance is distilled into its one branch"
            for name in ("guidance_scale", "guidance_scale_2"):
                value = getattr(request, name)
                if value is not None and value != self.default_guidance_scale:
                    return name, f"{value}: {why}; leave {name} unset (or {self.default_guidance_scale})"
            for name in ("negative_prompt", "negative_prompt_embeds"):
                if getattr(request, name) is not None:
                    return name, f"{why}, so a negative prompt would be ignored; leave {name} unset"
        if request.rollout is not None and self.step_distilled:
            return "rollout", f"{who}: its sampler is the one it was distilled with; rollouts sample base recipes with the SDE step"
        caching = request.caching
        if caching is not None and not self.admits_caching(caching.method):
            admitted = "no step caching" if not self.step_caching else f"only {', '.join(self.step_caching)}"
            reason = (": each of its few steps moves far along the trajectory, so a skipped step would reuse a "
                      "prediction that no longer holds") if self.step_distilled else ""  # fmt: skip
            return "cache", f"method {caching.method!r}: {who}, which admits {admitted}{reason}; pass cache='none' or leave it unset"
        return None
