"""Wan's parts for the denoise loop: UMT5 text, the Wan denoiser (one expert or two), video latents.

As diffusers' WanPipeline: each text is cleaned, tokenized and padded to the card's text length, its
encoder states zeroed past the text; a denoise step is DenoiseStep (steps.py) on
WanTransformer3DModel. With two experts (Wan 2.2 A14B, `transformer_2` and `boundary_ratio`) a step
whose timestep is >= boundary_ratio x the training timesteps runs the first expert with
`guidance_scale`, every later step the second with `guidance_scale_2` (whether both CFG branches run
is decided by `guidance_scale`, as there). Each expert's step is a kind of its own, so requests in
different stages batch with their own expert; a request switches once, its sampler history carrying on.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import regex  # diffusers' Wan pipeline cleans prompts with `regex` (its \s differs from `re`'s on a few characters)
import torch
from torch import nn

from fvgraph.adapters.slots import ROW_INPUTS
from fvgraph.card import ModelCard
from fvgraph.contract.denoise_update import carry_names
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.denoise_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.samplers import MAX_CARRY, SamplerPlan
from fvgraph.loops.state_check import check_text
from fvgraph.loops.steps import DenoiseStep, StepMedia, TextEncodeStep
from fvgraph.loops.taps import TapPoints
from fvgraph.models.components import Components
from fvgraph.models.wan_sections import WanSections
from fvgraph.request import Request

try:
    import ftfy  # optional, as in diffusers: where it is installed, prompts are fixed with it first
except ImportError:
    ftfy = None

DENOISE_2, DENOISE_CFG_2 = "denoise_2", "denoise_cfg_2"  # the low-noise expert's kinds
LOW_NOISE_KIND = {DENOISE: DENOISE_2, DENOISE_CFG: DENOISE_CFG_2}
# Inputs every denoise step of a request takes alike (DenoiseStep's arguments): conditioning parts
# pass some of these constants (i2v: condition, image_embeds; ti2v: first_frame, frame_mask).
CONDITIONING = ("condition", "image_embeds", "first_frame", "frame_mask")


def denoise_kind(name: str, cfg: bool, component: str = "transformer") -> StepKind:
    """A whole denoise step: latents, timestep and sampler row per step (and fresh noise for a sampler
    that re-noises); text (and guidance) constant, and on an engine with adapter slots each row's slots
    and scales (fvgraph/adapters/slots.py); the sampler's history carried."""
    texts = ("prompt_embeds", "negative_prompt_embeds", "guidance_scale") if cfg else ("prompt_embeds",)
    carry = dict.fromkeys(carry_names(MAX_CARRY), Role.CARRIED)
    return StepKind(name, component=component, phase="denoise", compiled=True, per_inference_step=True,
                    inputs={"latents": Role.STEP, "timestep": Role.STEP, "coeffs": Role.STEP, "fresh_noise": Role.STEP,
                            **dict.fromkeys((*texts, *CONDITIONING, *ROW_INPUTS), Role.CONSTANT), **carry},
                    outputs={"latents": Role.RESULT, **carry})  # fmt: skip


DENOISE_KINDS = {False: denoise_kind(DENOISE, cfg=False), True: denoise_kind(DENOISE_CFG, cfg=True)}
SECOND_EXPERT_KINDS = {
    DENOISE_2: denoise_kind(DENOISE_2, cfg=False, component="transformer_2"),
    DENOISE_CFG_2: denoise_kind(DENOISE_CFG_2, cfg=True, component="transformer_2"),
}
TEXT_ENCODE_KIND = StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                            inputs={"input_ids": Role.STEP, "attention_mask": Role.STEP}, outputs={"embeds": Role.RESULT})  # fmt: skip



def prompt_clean(text: str) -> str:
    """A prompt as WanPipeline cleans it before tokenizing: ftfy's fixes (where installed), HTML
    entities unescaped twice, runs of whitespace made one space, stripped. Equals diffusers'
    `diffusers.pipelines.wan.pipeline_wan.prompt_clean` (0.42.1; tests/test_wan_prompt_clean.py compares
    them), written out here so that loading Wan's parts loads no diffusers pipeline module."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return regex.sub(r"\s+", " ", text).strip()

class WanText:
    """UMT5: one encoder, its sequence zero-padded to the card's text length."""

    kind = TEXT_ENCODE_KIND
    reads: tuple[str, ...] = ()
    device_fields: tuple[str, ...] = ()

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components = card, components
        self.text_len, self.dtype = card.shapes.text_len, components.transformer.dtype

    def build(self, components: Components) -> nn.Module:
        return TextEncodeStep(components.text_encoder)

    def check(self, resolved: Request) -> None:
        pass

    def init_fields(self, request: Request) -> dict[str, Any]:
        return {}

    def given(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """[L, D] user embeddings -> [1, text_len, D], zero-padded as Wan's own encoder output is."""
        if embeds is None:
            return None
        pad = self.text_len - embeds.shape[0]
        embeds = torch.cat([embeds, embeds.new_zeros(pad, embeds.shape[1])]) if pad else embeds
        return embeds.unsqueeze(0).to(self.components.device, self.dtype)

    def tokenize(self, state: DenoiseState, request: Request, texts: list[tuple[str, str]]) -> None:
        tokens = self.components.tokenizer([prompt_clean(text) for _, text in texts], padding="max_length",
                                           max_length=self.text_len, truncation=True, add_special_tokens=True,
                                           return_attention_mask=True, return_tensors="pt")  # fmt: skip
        state.input_ids, state.attention_mask = tokens.input_ids, tokens.attention_mask

    def encode_inputs(self, state: DenoiseState) -> dict[str, torch.Tensor]:
        device = self.components.device
        return {"input_ids": state.input_ids.to(device), "attention_mask": state.attention_mask.to(device)}

    def take_encoded(self, state: DenoiseState, result: StepResult) -> None:
        embeds = result["embeds"].to(self.dtype)
        for row, slot in enumerate(state.encode_slots):
            setattr(state, slot, embeds[row : row + 1])

    def finish(self, state: DenoiseState) -> None:
        pass

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]:
        return {}

    def check_saved(self, checker: Any, state: DenoiseState) -> None:
        """A saved state's token ids and embeddings, as init and the text encoder shape them."""
        check_text(checker, state, self.text_len, self.components.facts.text_dim, self.dtype)

    def warmup_text(self, guidance_scale: float, with_encoder: bool) -> dict[str, Any]:
        if with_encoder:
            return {"prompt": "warmup"}
        zeros = torch.zeros(1, self.components.facts.text_dim)
        return {"prompt_embeds": zeros, "negative_prompt_embeds": zeros}


class WanDenoiser:
    """WanTransformer3DModel's denoise steps; with `two_experts`, transformer_2's below the boundary."""

    kinds = DENOISE_KINDS
    teacache_signal = WanSections.teacache_signal

    def __init__(self, card: ModelCard, components: Components, two_experts: bool = False, media: StepMedia | None = None):
        self.card = card
        self.two_experts = two_experts
        self.media = media  # how a request's image enters the step (I2V, TI2V), or None
        self.step_kinds = {DENOISE: DENOISE_KINDS[False], DENOISE_CFG: DENOISE_KINDS[True],
                           **(SECOND_EXPERT_KINDS if two_experts else {})}  # fmt: skip
        self.reads = ("guidance_scale_2",) if two_experts else ()
        self.boundary_timestep = None
        if two_experts:
            if components.transformer_2 is None or card.recipe.boundary_ratio is None:
                raise ValueError(f"card {card.card_id!r}: two experts need transformer_2 in the weights and "
                                 f"recipe.boundary_ratio; found experts {components.facts.experts}, "
                                 f"boundary_ratio={card.recipe.boundary_ratio}")  # fmt: skip
            train_steps = card.recipe.sampler.config.get("num_train_timesteps", 1000)
            self.boundary_timestep = card.recipe.boundary_ratio * train_steps

    def step(self, transformer: nn.Module, sampler: Any, cfg: bool, tap_points: TapPoints | None) -> nn.Module:
        return DenoiseStep(transformer, sampler, cfg=cfg, tap_points=tap_points, media=self.media)

    def steps(self, components: Components, sampler: Any, tap_points: Callable[[nn.Module], TapPoints | None]) -> dict[str, nn.Module]:
        experts = [(components.transformer, DENOISE_KINDS)]
        if self.two_experts:
            experts.append((components.transformer_2, {False: SECOND_EXPERT_KINDS[DENOISE_2], True: SECOND_EXPERT_KINDS[DENOISE_CFG_2]}))
        return {kind.name: self.step(transformer, sampler, cfg, tap_points(transformer))
                for transformer, kinds in experts for cfg, kind in kinds.items()}  # fmt: skip

    def sections(self, transformer: nn.Module) -> DenoiserSections:
        return WanSections(transformer, self.media)

    def check(self, resolved: Request) -> None:
        pass

    def init_fields(self, request: Request) -> dict[str, Any]:
        if not self.two_experts:
            return {}
        second = request.guidance_scale_2
        if second is None:
            second = self.card.recipe.default_guidance_scale_2
        return {"guidance_scale_2": float(request.guidance_scale if second is None else second)}

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]:
        return {}

    def _low_noise(self, state: DenoiseState) -> bool:
        return self.two_experts and bool(state.timesteps[state.step_index] < self.boundary_timestep)

    def changes_kind(self, state: DenoiseState) -> bool:
        return self._low_noise(state) and state.derived.kind not in SECOND_EXPERT_KINDS

    def at_step(self, state: DenoiseState, kind: str, constants: dict[str, torch.Tensor]) -> tuple[str, dict]:
        """The first expert's kind and constants, or the second's past the boundary."""
        if not self._low_noise(state):
            return kind, constants
        if "guidance_scale" in constants:
            constants = {**constants, "guidance_scale": torch.full_like(constants["guidance_scale"], state.guidance_scale_2)}
        return LOW_NOISE_KIND[kind], constants

    def warmup_guidance(self, guidance_scale: float) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale}


class VideoLatents:
    """[1, C, F, h, w] latents for `num_frames`, on the card's own schedule."""

    reads: tuple[str, ...] = ()

    def check(self, request: Request) -> None:
        pass

    def planned(self, sampler: Any, num_steps: int, latent_hw: tuple[int, int], start: int = 0) -> SamplerPlan:
        return sampler.plan(num_steps, start)

    def warmup_frames(self, num_frames: int) -> dict[str, Any]:
        return {"num_frames": num_frames}

