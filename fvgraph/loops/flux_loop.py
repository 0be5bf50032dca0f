"""The FLUX.1 text-to-image loop: text_encode (CLIP pooled + T5) -> denoise x N -> vae_decode.

The family-neutral DenoiseLoop with FLUX's parts: what differs from Wan is what diffusers' FluxPipeline
does differently: two text encoders (CLIP's pooled output and T5's sequence, used as given, at the
request's `max_sequence_length`: `FluxText`), guidance as an input of the denoiser where the weights
take one (FLUX.1-dev; none for schnell: `FluxDenoising`), and an image's latents and schedule
(fvgraph/loops/image_parts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.denoise_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE, VAE_DECODE, DenoiseLoop
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.flux_steps import FluxDenoiseStep, FluxTextEncodeStep, ImageVaeDecodeStep
from fvgraph.loops.image_parts import ImageLatents, image_denoise_kind, refuse_embedded_guidance
from fvgraph.loops.loop_parts import Decoder, FamilyParts, LoopConfig
from fvgraph.loops.state_check import EMBED_SLOTS
from fvgraph.loops.taps import TapPoints
from fvgraph.models.components import Components
from fvgraph.models.flux_sections import FluxSections
from fvgraph.request import Request, RequestRejected


def flux_denoise_kind(name: str, cfg: bool, media: tuple[str, ...] = ()) -> StepKind:
    """Latents, timestep and Euler row per step; the texts, pooled texts, embedded guidance, the
    true-CFG scale and `media` (Kontext's image latents) constant for the request."""
    texts = ("prompt_embeds", "pooled_prompt_embeds", "guidance")
    if cfg:
        texts += ("negative_prompt_embeds", "negative_pooled_prompt_embeds", "guidance_scale")
    return image_denoise_kind(name, texts + media)


DENOISE_KINDS = {False: flux_denoise_kind(DENOISE, cfg=False), True: flux_denoise_kind(DENOISE_CFG, cfg=True)}
TEXT_ENCODE_KIND = StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                            inputs={"input_ids": Role.STEP, "input_ids_2": Role.STEP},
                            outputs={"pooled": Role.RESULT, "embeds": Role.RESULT})  # fmt: skip
FLUX_DECODER = Decoder(StepKind(VAE_DECODE, component="vae", phase="vae_decode", inputs={"latents": Role.STEP},
                                outputs={"video": Role.RESULT}), lambda c: ImageVaeDecodeStep(c.vae),
                       ImageVaeDecodeStep.postprocess)  # fmt: skip
POOLED = {"prompt_embeds": "pooled_prompt_embeds", "negative_prompt_embeds": "negative_pooled_prompt_embeds"}


@dataclass
class FluxState(DenoiseState):
    """DenoiseState plus the pooled texts, the T5 ids and the embedded guidance; `guidance_scale` is the
    true-CFG scale and `latents` are [1, C, 1, h, w]."""

    pooled_prompt_embeds: torch.Tensor | None = None  # [1, P]
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    input_ids_2: torch.Tensor | None = None  # [n_texts, max_sequence_length] T5 ids, rows as input_ids
    text_len: int = 0  # the T5 sequence length this request runs
    guidance: float | None = None  # the denoiser's embedded guidance (None: the weights take none)


class FluxText:
    """CLIP's pooled text and T5's sequence (of `prompt_2` where given), both used as given."""

    kind = TEXT_ENCODE_KIND
    reads = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds", "max_sequence_length")
    device_fields = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components = card, components
        self.dtype = components.transformer.dtype
        self.pooled_dim = int(components.transformer.config.pooled_projection_dim)

    def build(self, components: Components) -> nn.Module:
        return FluxTextEncodeStep(components.text_encoder, components.text_encoder_2)

    def check(self, resolved: Request) -> None:
        for embeds, pooled in POOLED.items():
            if getattr(resolved, embeds) is not None and getattr(resolved, pooled) is None:
                raise RequestRejected(pooled, f"{embeds} comes with {pooled} on card {self.card.card_id!r} (CLIP's pooled text)")
            value = getattr(resolved, pooled)
            if value is not None and value.shape[0] != self.pooled_dim:
                raise RequestRejected(pooled, f"shape {list(value.shape)}: card {self.card.card_id!r}'s denoiser takes [{self.pooled_dim}]")
        positive, negative = resolved.prompt_embeds, resolved.negative_prompt_embeds
        if resolved.do_cfg and positive is not None and negative is not None and positive.shape != negative.shape:
            raise RequestRejected("negative_prompt_embeds", f"shape {list(negative.shape)} must equal prompt_embeds' "
                                                            f"{list(positive.shape)} (both branches run as one batch)")  # fmt: skip

    def init_fields(self, request: Request) -> dict[str, Any]:
        device = self.components.device
        pooled = {name: None if getattr(request, name) is None else getattr(request, name).view(1, -1).to(device, self.dtype)
                  for name in POOLED.values()}  # fmt: skip
        if not request.do_cfg:
            pooled["negative_pooled_prompt_embeds"] = None
        text_len = request.max_sequence_length if request.prompt_embeds is None else request.prompt_embeds.shape[0]
        return {**pooled, "text_len": int(text_len)}

    def given(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """[L, D] user embeddings -> [1, L, D]: FluxPipeline uses them as given (T5 pads with tokens, not zeros)."""
        return None if embeds is None else embeds.unsqueeze(0).to(self.components.device, self.dtype)

    def tokenize(self, state: FluxState, request: Request, texts: list[tuple[str, str]]) -> None:
        """CLIP ids of each text and T5 ids of its second text (`prompt_2`, else the text itself)."""
        second = {"prompt_embeds": request.prompt_2, "negative_prompt_embeds": request.negative_prompt_2}
        clip, t5 = self.components.tokenizer, self.components.tokenizer_2
        state.input_ids = clip([text for _, text in texts], padding="max_length", max_length=clip.model_max_length,
                               truncation=True, return_tensors="pt").input_ids  # fmt: skip
        state.input_ids_2 = t5([second[slot] or text for slot, text in texts], padding="max_length", max_length=state.text_len,
                               truncation=True, return_tensors="pt").input_ids  # fmt: skip

    def encode_inputs(self, state: FluxState) -> dict[str, torch.Tensor]:
        device = self.components.device
        return {"input_ids": state.input_ids.to(device), "input_ids_2": state.input_ids_2.to(device)}

    def take_encoded(self, state: FluxState, result: StepResult) -> None:
        embeds, pooled = result["embeds"].to(self.dtype), result["pooled"].to(self.dtype)
        for row, slot in enumerate(state.encode_slots):
            setattr(state, slot, embeds[row : row + 1])
            setattr(state, POOLED[slot], pooled[row : row + 1])
        state.input_ids_2 = None

    def finish(self, state: FluxState) -> None:
        pass

    def constants(self, state: FluxState) -> dict[str, torch.Tensor]:
        inputs = {"pooled_prompt_embeds": state.pooled_prompt_embeds}
        if state.cfg:
            inputs["negative_pooled_prompt_embeds"] = state.negative_pooled_prompt_embeds
        return inputs

    def check_saved(self, checker: Any, state: FluxState) -> None:
        """Token ids as `tokenize` makes them, and each text as a T5 sequence at the request's own length
        beside its CLIP pooled vector, in the denoiser's dtype."""
        text_len, text_dim = self.card.shapes.text_len, self.components.facts.text_dim
        if isinstance(state.text_len, bool) or not isinstance(state.text_len, int) or not 1 <= state.text_len <= text_len:
            checker.fail("text_len", f"must be an int in [1, {text_len}], got {state.text_len!r}")
        needed = list(EMBED_SLOTS[: 2 if state.cfg else 1])
        if state.phase == "encode":
            if not isinstance(state.encode_slots, list) or not state.encode_slots or not set(state.encode_slots) <= set(needed):
                checker.fail("encode_slots", f"must list some of {needed}, got {state.encode_slots!r}")
            rows = len(state.encode_slots)
            for name, length in (("input_ids", self.components.tokenizer.model_max_length), ("input_ids_2", state.text_len)):
                ids = checker.tensor(name, dims=2, floating=False)
                if tuple(ids.shape) != (rows, length):
                    checker.fail(name, f"must be [{rows}, {length}], got {list(ids.shape)}")
            needed = [name for name in needed if name not in state.encode_slots]
        for name in needed:
            for field, shape in ((name, (1, state.text_len, text_dim)), (POOLED[name], (1, self.pooled_dim))):
                value = checker.tensor(field, shape=shape)
                if value.dtype != self.dtype:
                    checker.fail(field, f"must be {self.dtype}, got {value.dtype}")

    def warmup_text(self, guidance_scale: float, with_encoder: bool) -> dict[str, Any]:
        if with_encoder:
            return {"prompt": "warmup"}
        return {"prompt_embeds": torch.zeros(self.card.shapes.text_len, self.components.facts.text_dim),
                "pooled_prompt_embeds": torch.zeros(self.pooled_dim)}  # fmt: skip


class FluxDenoising:
    """FluxTransformer2DModel's steps: guidance embedded in the denoiser where its weights take it."""

    kinds = DENOISE_KINDS
    step_kinds = {DENOISE: DENOISE_KINDS[False], DENOISE_CFG: DENOISE_KINDS[True]}
    reads: tuple[str, ...] = ()
    teacache_signal = FluxSections.teacache_signal

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components = card, components
        self.spatial = components.facts.vae_spatial
        self.guidance_embeds = bool(components.transformer.config.get("guidance_embeds", False))

    def step(self, transformer: nn.Module, sampler: Any, cfg: bool, tap_points: TapPoints | None) -> nn.Module:
        return FluxDenoiseStep(transformer, sampler, cfg, self.spatial, tap_points)

    def steps(self, components: Components, sampler: Any, tap_points: Callable[[nn.Module], TapPoints | None]) -> dict[str, nn.Module]:
        taps = tap_points(components.transformer)
        return {kind.name: self.step(components.transformer, sampler, cfg, taps) for cfg, kind in self.kinds.items()}

    def sections(self, transformer: nn.Module) -> DenoiserSections:
        return FluxSections(transformer, self.spatial)

    def check(self, resolved: Request) -> None:
        if not self.guidance_embeds:
            refuse_embedded_guidance(self.card, resolved)

    def init_fields(self, request: Request) -> dict[str, Any]:
        return {"guidance": float(request.guidance_scale) if self.guidance_embeds else None}

    def constants(self, state: FluxState) -> dict[str, torch.Tensor]:
        if state.guidance is None:
            return {}
        return {"guidance": torch.tensor([state.guidance], dtype=torch.float32, device=self.components.device)}

    def changes_kind(self, state: DenoiseState) -> bool:
        return False

    def at_step(self, state: DenoiseState, kind: str, constants: dict[str, torch.Tensor]) -> tuple[str, dict]:
        return kind, constants

    def warmup_guidance(self, guidance_scale: float) -> dict[str, Any]:
        """`guidance_scale` is the embedded guidance (a value of the step, not a kind of it): the request
        runs the one-branch kind, as the card's default does; a true-CFG kind compiles at its first use."""
        return {"guidance_scale": guidance_scale} if self.guidance_embeds else {}


class FluxLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        parts = FamilyParts("flux", FluxState, FluxText(card, components), FluxDenoising(card, components),
                            ImageLatents(card), FLUX_DECODER)  # fmt: skip
        super().__init__(card, components, parts, config)
