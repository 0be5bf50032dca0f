"""The Qwen-Image text-to-image loop: text_encode (Qwen2.5-VL) -> denoise x N -> vae_decode.

The family-neutral DenoiseLoop with Qwen-Image's parts: an image family (fvgraph/loops/image_parts.py:
a one-frame video, the shifted image schedule, true CFG) that reads its text as diffusers' QwenImagePipeline does: each text wrapped in the pipeline's prompt
template, Qwen2.5-VL's last hidden state over the text's own tokens with the template's system
prompt dropped, cut at the request's `max_sequence_length`. Texts differ in length, so the two texts
of a request are zero-padded to one length (the longer, rounded up to TEXT_BUCKET tokens so that
requests share step signatures) with a padding mask the denoiser attends by: a request-constant
input of the step. The combined true-CFG prediction is rescaled to the cond prediction's norm, and
the VAE's latents_mean / latents_std are undone before decoding (VaeDecodeStep, as Wan's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.denoise_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE, DenoiseLoop
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.image_parts import ImageLatents, image_denoise_kind, refuse_embedded_guidance
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.loops.qwen_image_steps import QwenImageDenoiseStep, QwenTextEncodeStep
from fvgraph.loops.state_check import EMBED_SLOTS
from fvgraph.loops.taps import TapPoints
from fvgraph.loops.vae_decoder import NORMALIZED_VAE_DECODER
from fvgraph.models.components import Components
from fvgraph.request import Request

# QwenImagePipeline.__init__'s prompt_template_encode, prompt_template_encode_start_idx and tokenizer_max_length.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                   "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                   "<|im_start|>assistant\n")  # fmt: skip
TEMPLATE_DROP = 34  # the template's leading tokens (its system prompt), dropped from the hidden states
TOKENIZER_MAX_LENGTH = 1024
TEXT_BUCKET = 64  # padded text lengths are multiples of this: one compiled step serves every text up to it
MASKS = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}


def qwen_denoise_kind(name: str, cfg: bool, media: tuple[str, ...] = ()) -> StepKind:
    """Latents, timestep and Euler row per step; the texts, their masks, the true-CFG scale and `media`
    (Qwen-Image-Edit's image latents) constant."""
    texts = ("prompt_embeds", "prompt_embeds_mask")
    if cfg:
        texts += ("negative_prompt_embeds", "negative_prompt_embeds_mask", "guidance_scale")
    return image_denoise_kind(name, texts + media)


DENOISE_KINDS = {False: qwen_denoise_kind(DENOISE, cfg=False), True: qwen_denoise_kind(DENOISE_CFG, cfg=True)}
TEXT_ENCODE_KIND = StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                            inputs={"input_ids": Role.STEP, "attention_mask": Role.STEP}, outputs={"embeds": Role.RESULT})  # fmt: skip


@dataclass
class QwenImageState(DenoiseState):
    """DenoiseState plus the texts' padding masks; `guidance_scale` is the true-CFG scale, `latents` are
    [1, C, 1, h, w]. Until text encoding ends each text keeps its own length; then both are cut at
    `max_sequence_length` and padded to one (a multiple of TEXT_BUCKET)."""

    prompt_embeds_mask: torch.Tensor | None = None  # [1, L] int64, 1 for the text's tokens
    negative_prompt_embeds_mask: torch.Tensor | None = None
    max_sequence_length: int = 0  # the request's: text tokens past it are cut, as QwenImagePipeline.encode_prompt


class QwenText:
    """Qwen2.5-VL's last hidden state over each text's own tokens, the template's system prompt dropped."""

    kind = TEXT_ENCODE_KIND
    reads = ("prompt_embeds_mask", "negative_prompt_embeds_mask", "max_sequence_length")
    template, template_drop = PROMPT_TEMPLATE, TEMPLATE_DROP
    device_fields = ("prompt_embeds_mask", "negative_prompt_embeds_mask")

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components = card, components
        self.dtype = components.transformer.dtype

    def build(self, components: Components) -> nn.Module:
        return QwenTextEncodeStep(components.text_encoder)

    def check(self, resolved: Request) -> None:
        pass

    def init_fields(self, request: Request) -> dict[str, Any]:
        masks = {}
        for embeds, mask in MASKS.items():
            given = getattr(request, embeds)
            if given is not None and (embeds == "prompt_embeds" or request.do_cfg):
                # No mask given: every token is attended to, as QwenImagePipeline takes embeddings without one.
                value = getattr(request, mask)
                masks[mask] = (torch.ones(given.shape[0], dtype=torch.int64) if value is None else value).view(1, -1)
        return {**masks, "max_sequence_length": int(request.max_sequence_length)}

    def given(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """[L, D] user embeddings -> [1, L, D]; cut and padded with the other text once both are known."""
        return None if embeds is None else embeds.unsqueeze(0).to(self.components.device, self.dtype)

    def tokenize(self, state: QwenImageState, request: Request, texts: list[tuple[str, str]]) -> None:
        tokens = self.components.tokenizer([self.template.format(text) for _, text in texts], padding=True, truncation=True,
                                           max_length=TOKENIZER_MAX_LENGTH + self.template_drop, return_tensors="pt")  # fmt: skip
        state.input_ids, state.attention_mask = tokens.input_ids, tokens.attention_mask

    def encode_inputs(self, state: QwenImageState) -> dict[str, torch.Tensor]:
        device = self.components.device
        return {"input_ids": state.input_ids.to(device), "attention_mask": state.attention_mask.to(device)}

    def take_encoded(self, state: QwenImageState, result: StepResult) -> None:
        embeds = result["embeds"]
        for row, slot in enumerate(state.encode_slots):
            # QwenImagePipeline._extract_masked_hidden, then e[drop_idx:]: the row's tokens after the system prompt.
            tokens = state.attention_mask[row].bool().nonzero().squeeze(1).to(embeds.device)
            kept = embeds[row].index_select(0, tokens)[self.template_drop :].to(self.dtype)
            setattr(state, slot, kept.unsqueeze(0))
            setattr(state, MASKS[slot], torch.ones(1, kept.shape[0], dtype=torch.int64))

    def finish(self, state: QwenImageState) -> None:
        """Every text is known here (encoded or given): cut each at max_sequence_length, pad both to one length."""
        slots = EMBED_SLOTS[: 2 if state.cfg else 1]
        texts = {slot: (getattr(state, slot)[:, : state.max_sequence_length], getattr(state, MASKS[slot])[:, : state.max_sequence_length])
                 for slot in slots}  # fmt: skip
        longest = max(embeds.shape[1] for embeds, _ in texts.values())
        length = min(-(-longest // TEXT_BUCKET) * TEXT_BUCKET, self.card.shapes.text_len)  # >= longest: cut at max_sequence_length
        for slot, (embeds, mask) in texts.items():
            pad = length - embeds.shape[1]
            setattr(state, slot, torch.cat([embeds, embeds.new_zeros(1, pad, embeds.shape[2])], dim=1))
            setattr(state, MASKS[slot], torch.cat([mask, mask.new_zeros(1, pad)], dim=1).to(embeds.device))

    def constants(self, state: QwenImageState) -> dict[str, torch.Tensor]:
        inputs = {"prompt_embeds_mask": state.prompt_embeds_mask}
        if state.cfg:
            inputs["negative_prompt_embeds_mask"] = state.negative_prompt_embeds_mask
        return inputs

    def check_saved(self, checker: Any, state: QwenImageState) -> None:
        """Token ids as _tokenize makes them; each text in the denoiser's dtype beside its 0/1 mask, both
        texts at one length once encoding ended."""
        text_len = self.card.shapes.text_len
        msl = state.max_sequence_length
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= text_len:
            checker.fail("max_sequence_length", f"must be an int in [1, {text_len}], got {msl!r}")
        needed = list(EMBED_SLOTS[: 2 if state.cfg else 1])
        if state.phase == Phase.ENCODE:
            if not isinstance(state.encode_slots, list) or not state.encode_slots or not set(state.encode_slots) <= set(needed):
                checker.fail("encode_slots", f"must list some of {needed}, got {state.encode_slots!r}")
            ids = checker.tensor("input_ids", dims=2, floating=False)
            checker.tensor("attention_mask", shape=tuple(ids.shape), floating=False)
            if ids.shape[0] != len(state.encode_slots):
                checker.fail("input_ids", f"must have {len(state.encode_slots)} rows, got {list(ids.shape)}")
            needed = [name for name in needed if name not in state.encode_slots]
        lengths = set()
        for name in needed:
            embeds = checker.tensor(name, dims=3)
            if embeds.shape[0] != 1 or embeds.shape[2] != self.components.facts.text_dim or not 1 <= embeds.shape[1] <= text_len:
                checker.fail(name, f"must be [1, L <= {text_len}, {self.components.facts.text_dim}], got {list(embeds.shape)}")
            if embeds.dtype != self.dtype:
                checker.fail(name, f"must be {self.dtype}, got {embeds.dtype}")
            mask = checker.tensor(MASKS[name], shape=(1, embeds.shape[1]), floating=False)
            if mask.dtype != torch.int64 or not ((mask == 0) | (mask == 1)).all():
                checker.fail(MASKS[name], f"must be int64 0/1, got {mask.dtype}")
            lengths.add(embeds.shape[1])
        if state.phase != Phase.ENCODE and len(lengths) > 1:
            checker.fail("negative_prompt_embeds", f"must be as long as prompt_embeds once encoded, got lengths {sorted(lengths)}")

    def warmup_text(self, guidance_scale: float, with_encoder: bool) -> dict[str, Any]:
        cfg = guidance_scale > 1
        if with_encoder:
            return {"prompt": "warmup", **({"negative_prompt": " "} if cfg else {})}
        embeds = torch.zeros(TEXT_BUCKET, self.components.facts.text_dim)
        return {"prompt_embeds": embeds, **({"negative_prompt_embeds": embeds} if cfg else {})}


class QwenDenoising:
    """QwenImageTransformer2DModel's steps. The step passes no guidance: diffusers' Qwen-Image timestep
    embedding takes none (its `guidance_embeds` path is unfinished there), so guidance_scale is refused
    whatever the config says. No denoiser sections yet: requests with `cache` are refused."""

    kinds = DENOISE_KINDS
    step_kinds = {DENOISE: DENOISE_KINDS[False], DENOISE_CFG: DENOISE_KINDS[True]}
    reads: tuple[str, ...] = ()
    teacache_signal = None

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.spatial = card, components.facts.vae_spatial

    def step(self, transformer: nn.Module, sampler: Any, cfg: bool, tap_points: TapPoints | None) -> nn.Module:
        return QwenImageDenoiseStep(transformer, sampler, cfg, self.spatial, tap_points)

    def steps(self, components: Components, sampler: Any, tap_points: Callable[[nn.Module], TapPoints | None]) -> dict[str, nn.Module]:
        taps = tap_points(components.transformer)
        return {kind.name: self.step(components.transformer, sampler, cfg, taps) for cfg, kind in DENOISE_KINDS.items()}

    def sections(self, transformer: nn.Module) -> DenoiserSections | None:
        return None

    def check(self, resolved: Request) -> None:
        refuse_embedded_guidance(self.card, resolved)

    def init_fields(self, request: Request) -> dict[str, Any]:
        return {}

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]:
        return {}

    def changes_kind(self, state: DenoiseState) -> bool:
        return False

    def at_step(self, state: DenoiseState, kind: str, constants: dict[str, torch.Tensor]) -> tuple[str, dict]:
        return kind, constants

    def warmup_guidance(self, guidance_scale: float) -> dict[str, Any]:
        return {"true_cfg_scale": guidance_scale}


class QwenImageLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        parts = FamilyParts("qwen_image", QwenImageState, QwenText(card, components), QwenDenoising(card, components),
                            ImageLatents(card), NORMALIZED_VAE_DECODER)  # fmt: skip
        super().__init__(card, components, parts, config)
