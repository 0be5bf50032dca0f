"""The HunyuanVideo-1.5 text-to-video loop: text_encode (Qwen2.5-VL + ByT5) -> denoise x N -> vae_decode.

The family-neutral DenoiseLoop with HunyuanVideo-1.5's parts, as diffusers' HunyuanVideo15Pipeline:
- text (`HunyuanText`): each text in the pipeline's chat (its system message, the text as the user's
  turn) padded to the template prefix + 1000 tokens, Qwen2.5-VL's third-to-last hidden state with the
  prefix dropped, beside its mask; ByT5 over the text's quoted parts ('Text "..."'), or zeros with a
  zero mask when it quotes nothing. Four tensors per text, request constants of every denoise step.
- image conditioning: zeros for text-to-video (inside the step, fvgraph/loops/hunyuan_video15_steps.py).
- denoiser (`HunyuanDenoiser`): ClassifierFreeGuidance at the request's `guidance_scale`: two branches
  for a scale other than 1, one (the negative text not encoded) for 1.
- latents (`HunyuanLatents`): [1, C, F, h, w] on the pipeline's schedule, sigmas linspace(1, 0, N + 1)[:-1]
  shifted by the scheduler's shift, timestep = sigma x 1000.
- decoder: the latents over the VAE's scaling factor, decoded.
The card's recipe is replaced by what the weights' folder says (fvgraph/loops/hunyuan_video15_recipe.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import HunyuanVideo15Pipeline, extract_glyph_texts, format_text_input
from torch import nn

from fvgraph.adapters.slots import ROW_INPUTS
from fvgraph.card import ModelCard
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.denoise_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE, VAE_DECODE, DenoiseLoop
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.hunyuan_video15_recipe import card_for_weights
from fvgraph.loops.hunyuan_video15_steps import TEMPLATE_PREFIX, HunyuanDenoiseStep, HunyuanTextEncodeStep, HunyuanVaeDecodeStep
from fvgraph.loops.hunyuan_video15_text_check import check_saved_texts
from fvgraph.loops.loop_parts import Decoder, FamilyParts, LoopConfig
from fvgraph.loops.samplers import SamplerPlan
from fvgraph.loops.taps import TapPoints
from fvgraph.models.components import Components
from fvgraph.models.hunyuan_video15_forward import VISION_TOKENS, HunyuanVideo15TextToVideo
from fvgraph.models.hunyuan_video15_sections import HunyuanVideo15Sections
from fvgraph.request import Request, RequestRejected

LOOP = "hunyuan_video15_t2v"
TEXT_LEN = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length
GLYPH_LEN = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length
# The system message HunyuanVideo15Pipeline wraps every text with (its encode helper's default, the same text as its __init__'s).
SYSTEM_MESSAGE = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
EMBEDS = ("prompt_embeds", "negative_prompt_embeds")
# Beside each text's Qwen embeddings: their mask, ByT5's embeddings and their mask (the pipeline's names).
BESIDE = {slot: (f"{slot}_mask", f"{slot}_2", f"{slot}_mask_2") for slot in EMBEDS}


def denoise_kind(name: str, cfg: bool) -> StepKind:
    """Latents, timestep and Euler row per step (and a rollout's fresh noise); each text's four tensors
    (and the guidance scale) and the rows' adapter slots and scales (fvgraph/adapters/slots.py) constant."""
    texts = [slot for slot in EMBEDS[: 2 if cfg else 1] for slot in (slot, *BESIDE[slot])] + (["guidance_scale"] if cfg else [])
    texts += ROW_INPUTS
    return StepKind(name, component="transformer", phase="denoise", compiled=True, per_inference_step=True,
                    inputs={"latents": Role.STEP, "timestep": Role.STEP, "coeffs": Role.STEP, "fresh_noise": Role.STEP,
                            **dict.fromkeys(texts, Role.CONSTANT)},
                    outputs={"latents": Role.RESULT})  # fmt: skip


DENOISE_KINDS = {False: denoise_kind(DENOISE, cfg=False), True: denoise_kind(DENOISE_CFG, cfg=True)}
TEXT_ENCODE_KIND = StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                            inputs=dict.fromkeys(("input_ids", "attention_mask", "glyph_ids", "glyph_mask"), Role.STEP),
                            outputs={"embeds": Role.RESULT, "glyph_embeds": Role.RESULT})  # fmt: skip
DECODER = Decoder(StepKind(VAE_DECODE, component="vae", phase="vae_decode", inputs={"latents": Role.STEP}, outputs={"video": Role.RESULT}),
                  lambda c: HunyuanVaeDecodeStep(c.vae), HunyuanVaeDecodeStep.postprocess)  # fmt: skip


@dataclass
class HunyuanVideo15State(DenoiseState):
    """DenoiseState plus each text's Qwen mask and ByT5 embeddings and mask; until the texts are
    encoded, ByT5's token ids and mask of each text to encode (a zero mask: no quoted text).
    Requests carry texts only (HunyuanText.check), so rollouts send each sample its text."""

    embeds_given: ClassVar[bool] = False

    glyph_ids: torch.Tensor | None = None  # [n_texts, 256] int64
    glyph_mask: torch.Tensor | None = None
    prompt_embeds_mask: torch.Tensor | None = None  # [1, 1000] int64
    prompt_embeds_2: torch.Tensor | None = None  # [1, 256, D2]
    prompt_embeds_mask_2: torch.Tensor | None = None  # [1, 256] int64
    negative_prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_2: torch.Tensor | None = None
    negative_prompt_embeds_mask_2: torch.Tensor | None = None


class HunyuanText:
    """Qwen2.5-VL over the chat-templated text, ByT5 over its quoted parts."""

    kind = TEXT_ENCODE_KIND
    reads: tuple[str, ...] = ()
    device_fields = tuple(name for slot in EMBEDS for name in BESIDE[slot])

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components = card, components
        self.dtype = components.transformer.dtype

    def build(self, components: Components) -> nn.Module:
        return HunyuanTextEncodeStep(components.text_encoder, components.text_encoder_2)

    def check(self, resolved: Request) -> None:
        for name in EMBEDS:
            if getattr(resolved, name) is not None:
                raise RequestRejected(name, f"card {self.card.card_id!r} encodes its texts itself (Qwen2.5-VL and ByT5, "
                                            f"four tensors per text); pass {name.removesuffix('_embeds')} as text")  # fmt: skip

    def init_fields(self, request: Request) -> dict[str, Any]:
        return {}

    def given(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        return None  # refused by check: texts only

    def tokenize(self, state: HunyuanVideo15State, request: Request, texts: list[tuple[str, str]]) -> None:
        """As the pipeline's _get_mllm_prompt_embeds and _get_byt5_prompt_embeds tokenize each text."""
        chats = format_text_input([text for _, text in texts], SYSTEM_MESSAGE)
        tokens = self.components.tokenizer.apply_chat_template(
            chats, add_generation_prompt=True, tokenize=True, return_dict=True, padding="max_length",
            max_length=TEXT_LEN + TEMPLATE_PREFIX, truncation=True, return_tensors="pt")  # fmt: skip
        state.input_ids, state.attention_mask = tokens["input_ids"], tokens["attention_mask"]
        glyphs = [extract_glyph_texts(text) for _, text in texts]
        glyph = self.components.tokenizer_2([g or "" for g in glyphs], padding="max_length", max_length=GLYPH_LEN, truncation=True,
                                            add_special_tokens=True, return_tensors="pt")  # fmt: skip
        quoted = torch.tensor([g is not None for g in glyphs]).view(-1, 1)
        state.glyph_ids, state.glyph_mask = glyph["input_ids"], glyph["attention_mask"] * quoted

    def encode_inputs(self, state: HunyuanVideo15State) -> dict[str, torch.Tensor]:
        device = self.components.device
        return {"input_ids": state.input_ids.to(device), "attention_mask": state.attention_mask.to(device),
                "glyph_ids": state.glyph_ids.to(device), "glyph_mask": state.glyph_mask.to(device)}  # fmt: skip

    def take_encoded(self, state: HunyuanVideo15State, result: StepResult) -> None:
        embeds, glyph = result["embeds"], result["glyph_embeds"]
        for row, slot in enumerate(state.encode_slots):
            mask, glyph_slot, glyph_mask = BESIDE[slot]
            setattr(state, slot, embeds[row : row + 1].to(self.dtype))
            setattr(state, mask, state.attention_mask[row : row + 1, TEMPLATE_PREFIX:].to(embeds.device))
            setattr(state, glyph_slot, glyph[row : row + 1].to(self.dtype))
            setattr(state, glyph_mask, state.glyph_mask[row : row + 1].to(embeds.device))
        state.glyph_ids = state.glyph_mask = None

    def finish(self, state: HunyuanVideo15State) -> None:
        pass

    def constants(self, state: HunyuanVideo15State) -> dict[str, torch.Tensor]:
        return {name: getattr(state, name) for slot in EMBEDS[: 2 if state.cfg else 1] for name in BESIDE[slot]}

    def check_saved(self, checker: Any, state: HunyuanVideo15State) -> None:
        check_saved_texts(checker, state, self.components, self.dtype, (TEXT_LEN, GLYPH_LEN), BESIDE)

    def warmup_text(self, guidance_scale: float, with_encoder: bool) -> dict[str, Any]:
        return {"prompt": "warmup", **({"negative_prompt": " "} if guidance_scale != 1 else {})}


class HunyuanDenoiser:
    """HunyuanVideo15Transformer3DModel's steps with ClassifierFreeGuidance, and its denoiser sections
    for step caching (fvgraph/models/hunyuan_video15_sections.py). `kinds`: the denoise kinds by CFG
    (image-to-video's take the image's two constants besides)."""

    reads: tuple[str, ...] = ()
    teacache_signal = HunyuanVideo15Sections.teacache_signal

    def __init__(self, card: ModelCard, kinds: dict[bool, StepKind] = DENOISE_KINDS, image_tokens: int = VISION_TOKENS):
        self.card = card
        self.kinds = kinds
        self.image_tokens = image_tokens  # the image stream's length: SigLIP's tokens on an image-to-video card
        self.step_kinds = {kind.name: kind for kind in kinds.values()}

    def step(self, transformer: nn.Module, sampler: Any, cfg: bool, tap_points: TapPoints | None) -> nn.Module:
        return HunyuanDenoiseStep(HunyuanVideo15TextToVideo(transformer), sampler, cfg, tap_points)

    def steps(self, components: Components, sampler: Any, tap_points: Callable[[nn.Module], TapPoints | None]) -> dict[str, nn.Module]:
        """Both kinds call one denoiser, whose blocks the parity taps (one set of hooks) read."""
        denoiser = HunyuanVideo15TextToVideo(components.transformer)
        taps = tap_points(denoiser)
        return {kind.name: HunyuanDenoiseStep(denoiser, sampler, cfg, taps) for cfg, kind in self.kinds.items()}

    def sections(self, transformer: nn.Module) -> DenoiserSections | None:
        return HunyuanVideo15Sections(transformer, GLYPH_LEN, self.image_tokens)

    def check(self, resolved: Request) -> None:
        if resolved.guidance_scale < 1:
            raise RequestRejected("guidance_scale", f"{resolved.guidance_scale}: card {self.card.card_id!r} runs classifier-free "
                                                    "guidance for a scale > 1 and none for 1; give a scale >= 1")  # fmt: skip

    def init_fields(self, request: Request) -> dict[str, Any]:
        return {}

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]:
        return {}

    def changes_kind(self, state: DenoiseState) -> bool:
        return False

    def at_step(self, state: DenoiseState, kind: str, constants: dict[str, torch.Tensor]) -> tuple[str, dict]:
        return kind, constants

    def warmup_guidance(self, guidance_scale: float) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale}


class HunyuanLatents:
    """[1, C, F, h, w] latents; HunyuanVideo15Pipeline's schedule: sigmas linspace(1, 0, N + 1)[:-1],
    shifted by the scheduler (its set_timesteps with those sigmas), each request's plan memoized per N."""

    reads: tuple[str, ...] = ()

    def __init__(self, card: ModelCard):
        self._scheduler = FlowMatchEulerDiscreteScheduler(**card.recipe.sampler.config)  # schedule only; never stepped
        self._plans: dict[int, SamplerPlan] = {}

    def check(self, request: Request) -> None:
        pass

    def planned(self, sampler: Any, num_steps: int, latent_hw: tuple[int, int], start: int = 0) -> SamplerPlan:
        if start:  # the loop takes no `strength` (its Request field is refused before this)
            raise ValueError(f"a text-to-video schedule starts at its first step, not step {start}")
        if num_steps not in self._plans:
            self._scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
            sigmas = self._scheduler.sigmas.to(torch.float32)
            coeffs = torch.stack([sigmas[:-1], sigmas[1:] - sigmas[:-1]], dim=1)
            self._plans[num_steps] = SamplerPlan(self._scheduler.timesteps.clone(), coeffs)
        return self._plans[num_steps]

    def warmup_frames(self, num_frames: int) -> dict[str, Any]:
        return {"num_frames": num_frames}


class HunyuanVideo15Loop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        if components.text_encoder is None:  # its requests carry texts only: without the encoders none could run
            raise ValueError(f"card {card.card_id!r} encodes its texts itself (four tensors per text; prompt_embeds are not "
                             "taken): build its engine with the text encoders (text_encoder=True)")  # fmt: skip
        card = card_for_weights(card, components)  # the folder's shift, guidance scale and default size
        parts = FamilyParts(LOOP, HunyuanVideo15State, HunyuanText(card, components), HunyuanDenoiser(card), HunyuanLatents(card), DECODER,
                            rollouts=True)  # fmt: skip
        super().__init__(card, components, parts, config)
