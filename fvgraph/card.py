"""ModelCard: the typed, validated description of a servable model.

A card owns what a model *is* (its components and where their weights come from), the loops it can
run, the recipe that produced the weights (and so the sampler and step counts they assume), the
parity tolerances its faster paths must meet, and the limits it serves. Facts that follow from the
weights (widths, channels, patch size, VAE scales, experts) are not here: they are read from the
loaded components' configs (fvgraph/contract/model_facts.py), so a resized checkpoint loads with its family's
card. Everything here is validated before a single weight loads; compile, graphs and caches are
applied from outside.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator

from fvgraph.caching.settings import CacheSettings

from fvgraph.caching.methods import parse_cache_settings
from fvgraph.latent_rgb import LatentRgbSpec
from fvgraph.recipe import Precision, RecipeSpec, SamplerSpec, TeaCacheCoefficients, _Spec
from fvgraph.torchvision_notes import drop_torchvision_fallback_notes

__all__ = ["ComponentSpec", "ModelCard", "ParitySpec", "Precision", "QuantizationSpec", "RecipeSpec", "SamplerSpec",
           "ShapeRules", "TeaCacheCoefficients", "Tolerance"]  # fmt: skip


class ComponentSpec(_Spec):
    """One component (DiT, VAE, text encoder, tokenizer) and how to obtain its weights."""

    kind: Literal["dit", "vae", "text_encoder", "tokenizer", "image_encoder", "image_processor"]
    cls: str = Field(description="Import path of the class, e.g. 'diffusers.WanTransformer3DModel'.")
    subfolder: str = Field(description="Folder of this component inside a diffusers checkpoint.")
    config: dict[str, Any] | None = Field(
        default=None, description="Constructor config for seeded weights; None = load from a checkpoint."
    )
    dtype: Precision = Field(default="fp32", description="Dtype the component runs in.")
    optional: bool = Field(default=False, description="A checkpoint folder may lack it (e.g. a second expert).")

    @field_validator("cls")
    @classmethod
    def _importable_path(cls, value: str) -> str:
        module, _, name = value.rpartition(".")
        if not module or not name:
            raise ValueError(f"cls={value!r} must be a dotted import path like 'diffusers.AutoencoderKLWan'")
        return value

    def resolve_class(self) -> type:
        """The component's class, its module imported here: where a card's heavy code loads."""
        module, _, name = self.cls.rpartition(".")
        drop_torchvision_fallback_notes()  # before an image processor's module raises them
        return getattr(importlib.import_module(module), name)


class Tolerance(_Spec):
    """Elementwise tolerance: a tensor passes when |a - b| <= atol + rtol * |b| everywhere."""

    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)


class ParitySpec(_Spec):
    """Declared tolerances per precision and level ('component': one step; 'loop': final latents)."""

    tolerances: dict[Precision, dict[Literal["component", "loop"], Tolerance]]

    def tolerance(self, precision: str, level: str = "loop") -> Tolerance:
        try:
            return self.tolerances[precision][level]
        except KeyError:
            raise KeyError(f"card declares no parity tolerance for precision={precision!r} level={level!r}") from None


class ShapeRules(_Spec):
    """Limits the card serves; requests outside them are rejected before any work. The multiples
    height, width and frames must keep follow from the weights (ModelFacts), not from the card."""

    max_height: int = 1280
    max_width: int = 1280
    max_frames: int = 129
    default_height: int = 480
    default_width: int = 832
    default_frames: int = 81
    text_len: int = Field(description="Text sequence length the encoder pads to (Wan: 512).")


class QuantizationSpec(_Spec):
    """Which layers the FP8 path (opt level 3: fvgraph.kernels.fp8_weights + the quantize pass) leaves alone.

    Only linears with K and N multiples of 16 are ever quantized; this list protects the ones whose
    error the model amplifies. The usual picks for a DiT: the embedders (timestep / text conditioning
    drives every block's modulation), the output projection, and the first and last blocks.
    """

    fp8_exclude: tuple[str, ...] = Field(
        default=("patch_embedding", "condition_embedder.*", "proj_out"),
        description="fnmatch patterns over the denoiser's module names (e.g. 'blocks.0.*', 'proj_out'); "
        "a matching nn.Linear keeps its full-precision weight and is never rewritten. A pattern that "
        "matches no module is an error when the weights are quantized.",
    )


class ModelCard(_Spec):
    """A servable model: components, loops, recipe, parity and limits as one validated unit."""

    card_id: str
    family: str
    components: dict[str, ComponentSpec]
    loops: tuple[str, ...]
    recipe: RecipeSpec
    parity: ParitySpec
    shapes: ShapeRules
    pipeline_class: str = Field(default="WanPipeline", description="diffusers pipeline a checkpoint of it is saved as.")
    hub_repos: tuple[str, ...] = Field(
        default=(), description="Hub repo ids (diffusers layout) the card's weights are published under, e.g. "
        "'Wan-AI/Wan2.1-T2V-1.3B-Diffusers': `checkpoint=` may name one, and a checkpoint that names one picks "
        "this card when no card is given (fvgraph/card_for_checkpoint.py). Empty for embedded and derived cards.",
    )
    quantization: QuantizationSpec = Field(
        default=QuantizationSpec(), description="FP8 exclusions of the quantized path (opt level 3)."
    )
    seed: int | None = Field(
        default=None, description="Seed for deterministic weights when the card embeds its own (no checkpoint)."
    )
    default_cache: SerializeAsAny[CacheSettings] | None = Field(
        default=None,
        description='Step caching a request gets when it gives no `cache` (docs/step_caching.md), e.g. '
        '{"method": "magcache", "threshold": 0.06}; a request opts out with cache="none".',
    )

    latent_rgb: LatentRgbSpec | None = Field(
        default=None, description="The family's published latent-to-RGB preview factors (fvgraph/latent_rgb.py). "
        "None: a card that embeds its weights fits its map from its own VAE; any other takes no previews.",
    )
    fps: int = Field(default=16, ge=1, le=120, description="The frame rate the family's videos are made at (a VideoArtifact's fps).")

    @field_validator("default_cache", mode="before")
    @classmethod
    def _cache_settings(cls, value):
        return parse_cache_settings(value)

    @model_validator(mode="after")
    def _consistent(self) -> ModelCard:
        required = {"transformer", "vae", "text_encoder", "tokenizer"}
        missing = required - set(self.components)
        if missing:
            raise ValueError(f"card {self.card_id!r}: components is missing {sorted(missing)}")
        if self.recipe.assumes_loop not in self.loops:
            raise ValueError(
                f"card {self.card_id!r}: recipe.assumes_loop={self.recipe.assumes_loop!r} is not one of loops={self.loops}"
            )
        if self.default_cache is not None and not self.recipe.admits_caching(self.default_cache.method):
            raise ValueError(f"card {self.card_id!r}: default_cache method {self.default_cache.method!r} is not one "
                             f"recipe {self.recipe.name!r} admits (step_caching={self.recipe.step_caching})")
        if self.recipe.precision not in self.parity.tolerances:
            raise ValueError(f"card {self.card_id!r}: parity declares no tolerance for precision {self.recipe.precision!r}")
        return self

    @property
    def embeds_weights(self) -> bool:
        """True when every component can be built from the card alone (seeded weights)."""
        return all(spec.config is not None for spec in self.components.values())

    def recipe_in_effect(self) -> dict:
        """The recipe values a run of this card uses where a checkpoint folder may say otherwise
        (fvgraph/runtime/checkpoint_recipe.py), as a Result's provenance reports them."""
        shift = self.recipe.sampler.config.get("flow_shift")
        return {"flow_shift": None if shift is None else float(shift), "boundary_ratio": self.recipe.boundary_ratio,
                "expand_timesteps": self.recipe.assumes_loop == "ti2v"}  # fmt: skip
