"""FLUX.1 Kontext image editing: text_encode -> vae_encode (the image to edit) -> denoise x N -> vae_decode.

As diffusers' FluxKontextPipeline: the image is resized to the Kontext resolution nearest its aspect
ratio (PREFERRED_KONTEXT_RESOLUTIONS, the pipeline's `_auto_resize`; a request's `auto_resize=False`
keeps its own size), rounded down to multiples of 16 pixels, encoded by the VAE (the posterior's mode,
shifted and scaled as the VAE's config says), and its latents join the latents' tokens in every denoise
call, with position ids whose first axis is 1 (flux_steps.FluxDenoiser); the prediction is read from
the latents' tokens. Everything else is the FLUX loop's parts: the texts, the embedded guidance, true
CFG, the image schedule (shifted by the output's token count alone) and the decode. The output size is
the request's height x width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.loops.denoise_loop import DENOISE, DENOISE_CFG, DenoiseLoop
from fvgraph.loops.flux_loop import FLUX_DECODER, FluxDenoising, FluxState, FluxText, flux_denoise_kind
from fvgraph.loops.image_parts import ImageLatents
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.loops.tiled_coding import VAE_ENCODE, VAE_ENCODE_KIND
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected


# FLUX's denoise kinds plus the edited image's latents, a request constant.
DENOISE_KINDS = {cfg: flux_denoise_kind(name, cfg, media=("condition",)) for cfg, name in ((False, DENOISE), (True, DENOISE_CFG))}


@dataclass
class KontextState(FluxState):
    """FluxState plus the image to edit: `image` [1, 3, H, W] in [-1, 1] until encoded, then
    `condition`, its latents [1, C, 1, hc, wc]."""

    image: torch.Tensor | None = None
    condition: torch.Tensor | None = None


class KontextEncodeStep(nn.Module):
    """The image -> its latents as FluxKontextPipeline._encode_vae_image: the posterior's mode,
    (z - shift_factor) * scaling_factor, as a one-frame latent [B, C, 1, h, w]."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling = float(vae.config.scaling_factor)
        self.shift = float(vae.config.shift_factor or 0.0)

    def forward(self, image: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """`image` [B, 3, H, W] in [-1, 1]; `latents` is the plan's shape witness and is not read."""
        encoded = self.vae.encode(self.video(image, latents), return_dict=False)[0].mode()
        return self.condition(encoded, latents)

    def video(self, image: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return image.to(self.vae.dtype)

    def condition(self, encoded: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"condition": ((encoded - self.shift) * self.scaling).unsqueeze(2)}


class EditedImage:
    """Kontext's image: required, resized as the pipeline resizes it, encoded once, then a constant."""

    phases = (Phase.VAE_ENCODE,)
    step_kinds = {VAE_ENCODE: VAE_ENCODE_KIND}
    reads = ("image", "auto_resize")
    device_fields = ("image", "condition")

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components = card, components
        self.multiple_of = components.facts.vae_spatial * 2  # the VAE's factor and FLUX's 2x2 packing
        self.processor = VaeImageProcessor(vae_scale_factor=self.multiple_of)
        self.dtype = components.transformer.dtype

    def build(self, components: Components) -> dict[str, nn.Module]:
        return {VAE_ENCODE: KontextEncodeStep(components.vae)}

    def check(self, resolved: Request) -> None:
        if resolved.image is None:
            raise RequestRejected("image", f"card {self.card.card_id!r} edits an image: pass image=...")

    def resized(self, image: Any, auto_resize: bool | None = None) -> tuple[int, int]:
        """(height, width) the image is encoded at: the Kontext resolution nearest its aspect ratio, or
        with auto_resize=False its own size; either rounded down to the packed latents' multiple."""
        height, width = self.processor.get_default_height_width(image)
        if auto_resize is not False:
            _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        return height // self.multiple_of * self.multiple_of, width // self.multiple_of * self.multiple_of

    def init_fields(self, request: Request, latents: torch.Tensor) -> dict[str, Any]:
        height, width = self.resized(request.image, request.auto_resize)
        image = self.processor.preprocess(self.processor.resize(request.image, height, width), height, width)
        return {"image": image.to(self.components.device, self.dtype)}

    def first_phase(self, state: KontextState) -> Phase | None:
        return Phase.VAE_ENCODE if state.image is not None else None

    def plan(self, state: KontextState) -> WorkPlan:
        return WorkPlan(state.request_id, VAE_ENCODE, {"image": state.image, "latents": state.latents})

    def take(self, state: KontextState, result: StepResult) -> None:
        state.condition, state.image = result["condition"].to(self.dtype), None
        state.phase = Phase.DENOISE

    def constants(self, state: KontextState) -> dict[str, torch.Tensor]:
        return {"condition": state.condition}

    def after_last_step(self, state: KontextState) -> None:
        state.condition = None

    def check_saved(self, state: KontextState) -> None:
        for name in ("image", "condition"):
            value = getattr(state, name)
            if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != (4 if name == "image" else 5)
                                      or not value.is_floating_point() or not torch.isfinite(value).all()):  # fmt: skip
                raise ValueError(f"state of request {state.request_id!r}: {name}: must be a finite float tensor "
                                 f"of {4 if name == 'image' else 5} dims")  # fmt: skip
        if state.phase == Phase.DENOISE and state.condition is None:
            raise ValueError(f"state of request {state.request_id!r}: condition: a denoising edit needs its image's latents")

    def warmup_inputs(self, height: int, width: int) -> dict[str, Any]:
        return {"image": torch.full((height, width, 3), 128, dtype=torch.uint8)}


class KontextDenoising(FluxDenoising):
    """FLUX's denoiser with the edited image's tokens joined to the latents' (flux_steps.FluxDenoiser);
    step caching runs on FLUX's sections, whose stream holds the edit's image tokens too (its
    `condition` input, as diffusers' cache hooks see FluxKontextPipeline's calls)."""

    kinds = DENOISE_KINDS
    step_kinds = {DENOISE: DENOISE_KINDS[False], DENOISE_CFG: DENOISE_KINDS[True]}


class FluxKontextLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        parts = FamilyParts("flux_kontext", KontextState, FluxText(card, components), KontextDenoising(card, components),
                            ImageLatents(card), FLUX_DECODER, EditedImage(card, components))  # fmt: skip
        super().__init__(card, components, parts, config)
