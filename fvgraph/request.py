"""Request and Result: what crosses the public API boundary.

Argument names follow diffusers (prompt, negative_prompt, num_inference_steps, guidance_scale,
height, width, num_frames, output_type). Rules that hold for any Wan-family model are checked when a
Request is built (pydantic ValidationError, naming the field); rules that depend on the card (step
range the recipe allows, maximum size) or on the loaded weights (text width, the multiples a VAE and
patch size need: ModelFacts) are checked by `resolve()`, which raises RequestRejected. Either way
the engine is untouched and serves the next request.

Embeddings: `prompt_embeds` shorter than the card's text length are zero-padded to it, as Wan's own
pipeline pads its text encoder's output (diffusers' WanPipeline uses short embeddings as given, so
its results differ from fvgraph's for those).
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from fvgraph.adapters.names import bad_name
from fvgraph.artifacts import ImageArtifact, LatentArtifact, VideoArtifact
from fvgraph.behavior import BehaviorRecord, RolloutSampling
from fvgraph.card import ModelCard
from fvgraph.caching.settings import CacheSettings, NoCache
from fvgraph.caching.methods import parse_cache_settings
from fvgraph.contract.model_facts import ModelFacts
from fvgraph.media_file import write_video
from fvgraph.request_image import to_rgb_frames, to_rgb_image

# Ids are echoed into result lines, logs and file names: bounded, printable.
MAX_REQUEST_ID_LENGTH = 128

class RequestRejected(ValueError):
    """A request this card cannot serve; the message names the field, the value and the rule."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


def refuse_boolean(value: Any, info: ValidationInfo) -> Any:
    """A `mode="before"` field validator for number fields: pydantic would read True as 1. The one
    rule for Request and for the HTTP bodies that map onto it (fvgraph/serving/openai_requests.py)."""
    if isinstance(value, bool):
        raise ValueError(f"{info.field_name} must be a number, not a boolean ({value})")
    return value


def _dense_tensor(name: str, value: object, dims: int, shape: str) -> torch.Tensor:
    """`value` as a dense tensor holding data with `dims` dims (a leading batch of one dropped);
    ValueError naming `name` and the expected `shape` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta" or value.layout != torch.strided:
        raise ValueError(f"{name} must be a dense tensor holding data, got device {value.device.type} layout {value.layout}")
    if value.dim() == dims + 1 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != dims:
        raise ValueError(f"{name} must have shape {shape}, got {list(value.shape)} {value.dtype}")
    return value


def _finite_float(name: str, value: torch.Tensor) -> torch.Tensor:
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{name} contains NaN or Inf values")
    return value.detach()


def _check_embeds(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return None
    return _finite_float(name, _dense_tensor(name, value, 2, "[seq_len, dim] or [1, seq_len, dim]"))


class Request(BaseModel):
    """One text-to-video generation. Fields left None take the card's defaults in `resolve()`."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_assignment=True)

    prompt: str | None = None
    negative_prompt: str | None = Field(default=None, description="Defaults to '' when guidance is on.")
    prompt_embeds: torch.Tensor | None = Field(
        default=None,
        description="[seq_len, dim] or [1, seq_len, dim]; zero-padded to the card's text length as Wan pads its encoder output.",
    )
    negative_prompt_embeds: torch.Tensor | None = None
    prompt_2: str | None = Field(default=None, description="Cards with two text encoders (FLUX): the second's text (default: prompt).")
    negative_prompt_2: str | None = None
    pooled_prompt_embeds: torch.Tensor | None = Field(
        default=None, description="Cards with a pooled text input (FLUX): [dim] or [1, dim], passed with prompt_embeds.")
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    prompt_embeds_mask: torch.Tensor | None = Field(
        default=None, description="Cards whose text embeddings carry a padding mask (Qwen-Image): [seq_len] or [1, seq_len], "
        "1 where the denoiser attends to that token of prompt_embeds, 0 where it is padding (default: every token).")
    negative_prompt_embeds_mask: torch.Tensor | None = None
    true_cfg_scale: float | None = Field(
        default=None, ge=0.0, le=30.0,
        description="FLUX and Qwen-Image cards: > 1 with a negative prompt runs classifier-free guidance, as diffusers' "
        "true_cfg_scale (their guidance_scale is the denoiser's embedded guidance).",
    )
    max_sequence_length: int | None = Field(
        default=None, ge=1, le=4096, description="FLUX and Qwen-Image cards: the text length (default and maximum: the card's).")
    image: Any = Field(
        default=None,
        description="Image-to-video cards: the first frame. A path, PIL image, uint8 array/tensor [H, W, 3] "
        "(tensor also [3, H, W]) or float tensor in [0, 1]; kept as an RGB PIL image, resized to height x width.",
    )
    auto_resize: bool | None = Field(
        default=None,
        description="FLUX.1 Kontext cards: False encodes `image` at its own size (rounded down to multiples of 16 pixels) "
        "instead of the Kontext resolution nearest its aspect ratio (FluxKontextPipeline's `_auto_resize`, default True).",
    )
    video: Any = Field(
        default=None,
        description="Wan text-to-video cards: the video to start from (video-to-video). A list of frames (each as "
        "`image` takes it) or a uint8 array/tensor [T, H, W, 3]; resized to height x width, its frame count is num_frames.",
    )
    strength: float | None = Field(
        default=None, gt=0.0, le=1.0,
        description="With `video`: how far from the video to go, in (0, 1] (default 0.8, as diffusers): the last "
        "int(num_inference_steps * strength) steps run, from the video's latents noised to that step.",
    )
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=30.0, description="<= 1 disables CFG, as diffusers.")
    guidance_scale_2: float | None = Field(
        default=None, ge=0.0, le=30.0,
        description="Two-expert cards: the low-noise expert's guidance (default: the card's, else guidance_scale).",
    )
    height: int | None = Field(default=None, gt=0)
    width: int | None = Field(default=None, gt=0)
    num_frames: int | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    output_type: Literal["np", "latent"] = "np"
    cache: SerializeAsAny[CacheSettings] | None = Field(
        default=None,
        description='Step caching (docs/step_caching.md): {"method": "magcache", ...} with the method\'s settings, '
        'or the text "magcache:threshold=0.1"; an unknown method or field is rejected naming it. None (or left '
        'out): the card\'s `default_cache`; "none": no caching even where the card names a default.',
    )
    loras: dict[str, float] | None = Field(
        default=None,
        description="LoRA adapters loaded on the engine, name -> scale (docs/adapters.md), several at once; an "
        "unknown name is rejected naming it.",
    )
    rollout: RolloutSampling | None = Field(
        default=None,
        description="Sample as an RL rollout (docs/rollouts.md): Flow-GRPO's SDE step at rollout.noise_level, each "
        "transition's latents and log-prob recorded in Result.record.",
    )
    preview_every: int | None = Field(
        default=None, ge=1, le=1000,
        description="Step previews (docs/previews.md): after every k-th denoise step and after the last, the request's "
        "denoised estimate drawn small by the card's latent-to-RGB map (engine.generate(on_preview=...); an SSE "
        "`preview` event over HTTP). At most num_inference_steps. None: no previews, nothing copied to the host.",
    )
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12], min_length=1, max_length=MAX_REQUEST_ID_LENGTH,
                            description="Printable, at most 128 characters.")

    @field_validator("request_id")
    @classmethod
    def _printable_id(cls, value: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("request_id must be printable: no control characters such as newlines")
        return value

    _not_a_boolean = field_validator("num_inference_steps", "guidance_scale", "height", "width", "num_frames", "seed",
                                     "true_cfg_scale", "max_sequence_length", "preview_every", mode="before")(refuse_boolean)  # fmt: skip

    @field_validator("height", "width")
    @classmethod
    def _multiple_of_16(cls, value: int | None, info) -> int | None:
        if value is not None and value % 16:
            raise ValueError(f"{info.field_name}={value} must be a multiple of 16 (VAE x8, patch x2 at least)")
        return value

    @field_validator("num_frames")
    @classmethod
    def _four_k_plus_one(cls, value: int | None) -> int | None:
        if value is not None and value % 4 != 1:
            raise ValueError(f"num_frames={value} must be 4k+1 (1, 5, 9, ...): the VAE packs 4 frames per latent")
        return value

    @field_validator("guidance_scale", "guidance_scale_2", "true_cfg_scale")
    @classmethod
    def _finite_guidance(cls, value: float | None, info) -> float | None:
        if value is not None and not np.isfinite(value):
            raise ValueError(f"{info.field_name} must be a finite number")
        return value

    @field_validator("loras", mode="before")
    @classmethod
    def _lora_scales(cls, value):
        if isinstance(value, dict):
            for name, scale in value.items():
                why = bad_name(name)  # held to the rule loading holds names to, and quoted short
                if why is not None:
                    raise ValueError(why)
                if isinstance(scale, bool) or not isinstance(scale, int | float) or not np.isfinite(scale) or abs(scale) > 100:
                    raise ValueError(f"loras[{name!r}]={scale!r} must be a finite number in [-100, 100]")
        return value

    @field_validator("image")
    @classmethod
    def _valid_image(cls, value):
        return None if value is None else to_rgb_image(value)

    @field_validator("video")
    @classmethod
    def _valid_video(cls, value):
        return None if value is None else to_rgb_frames(value)

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_settings(cls, value):
        return parse_cache_settings(value)

    @field_validator("prompt_embeds", "negative_prompt_embeds")
    @classmethod
    def _valid_embeds(cls, value, info):
        return _check_embeds(info.field_name, value)

    @field_validator("pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    @classmethod
    def _valid_pooled(cls, value, info):
        return _check_pooled(info.field_name, value)

    @field_validator("prompt_embeds_mask", "negative_prompt_embeds_mask")
    @classmethod
    def _valid_mask(cls, value, info):
        return _check_mask(info.field_name, value)

    @model_validator(mode="after")
    def _has_text(self) -> Request:
        if self.prompt is None and self.prompt_embeds is None:
            raise ValueError("one of prompt or prompt_embeds is required")
        if self.prompt is not None and self.prompt_embeds is not None:
            raise ValueError("pass prompt or prompt_embeds, not both")
        if self.negative_prompt is not None and self.negative_prompt_embeds is not None:
            raise ValueError("pass negative_prompt or negative_prompt_embeds, not both")
        for pooled, embeds in (("pooled_prompt_embeds", "prompt_embeds"), ("negative_pooled_prompt_embeds", "negative_prompt_embeds")):
            if (getattr(self, pooled) is None) != (getattr(self, embeds) is None) and getattr(self, pooled) is not None:
                raise ValueError(f"{pooled} comes with {embeds}: pass both (or text)")
        for mask, embeds in (("prompt_embeds_mask", "prompt_embeds"), ("negative_prompt_embeds_mask", "negative_prompt_embeds")):
            value, tokens = getattr(self, mask), getattr(self, embeds)
            if value is not None and tokens is None:
                raise ValueError(f"{mask} masks {embeds}: pass {embeds} with it (text gets its mask from the tokenizer)")
            if value is not None and value.shape[0] != tokens.shape[0]:
                raise ValueError(f"{mask} has {value.shape[0]} entries, {embeds} {tokens.shape[0]} tokens: one entry per token")
        for second, first in (("prompt_2", "prompt"), ("negative_prompt_2", "negative_prompt")):
            if getattr(self, second) is not None and getattr(self, first) is None:
                raise ValueError(f"{second} is the second text encoder's text beside {first}: pass {first} too")
        if self.rollout is not None and self.caching is not None:
            raise ValueError("rollout with cache: a rollout records every transition it takes; send it without cache")
        return self

    @property
    def caching(self) -> CacheSettings | None:
        """The step caching this request runs with: None when it has none or turned it off ("none")."""
        return None if self.cache is None or isinstance(self.cache, NoCache) else self.cache

    @property
    def do_cfg(self) -> bool:
        """Whether the request runs two branches: true_cfg_scale > 1 (with the negative prompt resolve
        requires) on cards that guide with it, else guidance_scale > 1."""
        if self.true_cfg_scale is not None:
            return self.true_cfg_scale > 1.0
        return self.guidance_scale is not None and self.guidance_scale > 1.0

    def resolve(self, card: ModelCard, facts: ModelFacts | None = None) -> Request:
        """A copy with every default filled from the card, checked against the card's limits and,
        when given, the loaded weights' facts (text width, spatial and temporal multiples)."""
        recipe, shapes = card.recipe, card.shapes
        if problem := recipe.violation(card.card_id, self):  # steps, guidance and caching the recipe takes
            raise RequestRejected(*problem)
        values = self.model_dump()
        values["num_inference_steps"] = self.num_inference_steps or recipe.default_steps
        values["guidance_scale"] = (
            recipe.default_guidance_scale if self.guidance_scale is None else self.guidance_scale
        )
        values["height"] = self.height or shapes.default_height
        values["width"] = self.width or shapes.default_width
        values["num_frames"] = self.num_frames or (len(self.video) if self.video is not None else shapes.default_frames)
        _resolve_video(values, self, facts)
        values["seed"] = secrets.randbelow(2**31) if self.seed is None else self.seed
        _resolve_cfg_scale(values, self, card)
        values["max_sequence_length"] = self.max_sequence_length or shapes.text_len
        if values["max_sequence_length"] > shapes.text_len:
            raise RequestRejected("max_sequence_length", f"{values['max_sequence_length']} exceeds card {card.card_id!r}'s "
                                                         f"text length of {shapes.text_len}")  # fmt: skip
        # The settings object itself (a dump would be validated again); "none" stays NoCache, so
        # resolving twice never brings the card's default back.
        values["cache"] = card.default_cache if self.cache is None else self.cache
        if values["cache"] is not None and (problem := values["cache"].check_steps(values["num_inference_steps"])):
            raise RequestRejected(*problem)
        for name, limit in (("height", shapes.max_height), ("width", shapes.max_width), ("num_frames", shapes.max_frames)):
            if values[name] > limit:
                raise RequestRejected(name, f"{values[name]} exceeds card {card.card_id!r}'s maximum of {limit}")
        if facts is not None:
            _check_geometry(values, facts, card.card_id)
        for name in ("prompt_embeds", "negative_prompt_embeds"):
            embeds = values[name]
            width = facts.text_dim if facts is not None else embeds.shape[1] if embeds is not None else 0
            if embeds is not None and (embeds.shape[1] != width or embeds.shape[0] > shapes.text_len):
                raise RequestRejected(
                    name,
                    f"shape {list(embeds.shape)} does not fit card {card.card_id!r}: expected "
                    f"[seq_len <= {shapes.text_len}, {width}] (the width its weights take)",
                )
        return Request.model_validate(values)


def _resolve_video(values: dict, request: Request, facts: ModelFacts | None) -> None:
    """A video-to-video request's frames are its num_frames; `strength` comes with a video only."""
    if request.video is None:
        if request.strength is not None:
            raise RequestRejected("strength", "sets how far a video-to-video request goes from its video: give the video with it")
        return
    frames = len(request.video)
    if frames != values["num_frames"]:
        raise RequestRejected("video", f"has {frames} frames, num_frames is {values['num_frames']}: leave num_frames "
                                       "unset or give a video of that many frames")  # fmt: skip
    if facts is not None and (frames - 1) % facts.temporal_multiple:
        raise RequestRejected("video", f"has {frames} frames; the VAE packs {facts.temporal_multiple} frames per latent "
                                       f"frame, so it must have k*{facts.temporal_multiple}+1")  # fmt: skip
    values["strength"] = 0.8 if request.strength is None else request.strength  # diffusers' default
    if int(values["num_inference_steps"] * values["strength"]) < 1:
        raise RequestRejected("strength", f"{values['strength']} of {values['num_inference_steps']} steps runs none: "
                                          "int(num_inference_steps * strength) must be at least 1")  # fmt: skip


def _resolve_cfg_scale(values: dict, request: Request, card: ModelCard) -> None:
    """Which field turns CFG on is the recipe's (RecipeSpec.cfg_scale); the other is refused."""
    if card.recipe.cfg_scale == "guidance_scale":
        if request.true_cfg_scale is not None:
            raise RequestRejected("true_cfg_scale", f"card {card.card_id!r} turns classifier-free guidance on with "
                                                    "guidance_scale > 1; leave true_cfg_scale unset")  # fmt: skip
        return
    negative = request.negative_prompt is not None or request.negative_prompt_embeds is not None
    # As diffusers' pipelines: the default scale guides only a request that brings a negative prompt.
    default = card.recipe.default_true_cfg_scale if negative else 1.0
    values["true_cfg_scale"] = default if request.true_cfg_scale is None else request.true_cfg_scale
    if values["true_cfg_scale"] > 1.0 and not negative:
        raise RequestRejected("true_cfg_scale", f"{values['true_cfg_scale']} > 1 runs classifier-free guidance against a "
                                                "negative prompt: pass negative_prompt (or negative_prompt_embeds)")  # fmt: skip


def _check_mask(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
    """A text padding mask as diffusers' pipelines take it (bool, integer or float 0/1), kept as int64 0/1."""
    if value is None:
        return None
    value = _dense_tensor(name, value, 1, "[seq_len] or [1, seq_len] of 0/1 values")
    if value.is_complex() or not ((value == 0) | (value == 1)).all():
        raise ValueError(f"{name} must hold only 0 (padding) and 1 (a token the denoiser attends to)")
    return value.detach().to(torch.int64)


def _check_pooled(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return None
    return _finite_float(name, _dense_tensor(name, value, 1, "[dim] or [1, dim]"))


def _check_geometry(values: dict, facts: ModelFacts, card_id: str) -> None:
    """The multiples the loaded VAE and patch size need (Wan 2.2's 16x VAE needs 32, not 16)."""
    for name in ("height", "width"):
        if values[name] % facts.spatial_multiple:
            raise RequestRejected(
                name, f"{values[name]} must be a multiple of {facts.spatial_multiple} for card {card_id!r} "
                f"(VAE x{facts.vae_spatial}, patch x{facts.patch_size[1]})",
            )  # fmt: skip
    if (values["num_frames"] - 1) % facts.temporal_multiple:
        raise RequestRejected(
            "num_frames", f"{values['num_frames']} must be k*{facts.temporal_multiple}+1 for card {card_id!r}: "
            f"its VAE packs {facts.temporal_multiple} frames per latent frame",
        )  # fmt: skip


Status = Literal["ok", "rejected", "failed", "cancelled"]


@dataclass
class Result:
    """What a request produced. `frames` is uint8 [T, H, W, 3]; `latents` the final latents (CPU)."""

    request_id: str
    status: Status
    seed: int | None = None
    frames: np.ndarray | None = None
    latents: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    # With step caching: {"method", "computed", "reused"} in denoiser calls (one per CFG branch and step), and
    # {"flops", "flops_uncached"}: the FLOPs of the denoise steps that ran, and of the uncached step at every step.
    cache: dict | None = None
    # What produced it: card, weights version (merged adapters included), precision, the recipe values a
    # checkpoint may disagree with (flow_shift, boundary_ratio, expand_timesteps), and the request's adapters.
    provenance: dict = field(default_factory=dict)
    # A rollout request's record of every transition (fvgraph/behavior.py), else None.
    record: BehaviorRecord | None = None
    # Typed outputs with their provenance (fvgraph/artifacts.py): a LatentArtifact, then the VideoArtifact
    # or ImageArtifact of the decode; empty for a request that did not end ok.
    artifacts: list[LatentArtifact | VideoArtifact | ImageArtifact] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def images(self) -> np.ndarray | None:
        """The frames as images, uint8 [N, H, W, 3]: an image card's request gives one (N = 1)."""
        return self.frames

    def save(self, path: str | Path, fps: int = 8) -> Path:
        """Write the frames to `path`, the format by its extension: .mp4 (H.264 through PyAV, as
        diffusers' `export_to_video` writes one) or .gif at `fps`; a one-frame result also .png, .jpg
        or .webp (fvgraph/media_file.py). ValueError when the result has no frames or the file cannot
        hold them."""
        if self.frames is None:
            raise ValueError(f"request {self.request_id} ended {self.status!r} with no frames to save"
                             + (f": {self.error}" if self.error else ""))  # fmt: skip
        return write_video(self.frames, path, fps=fps)
