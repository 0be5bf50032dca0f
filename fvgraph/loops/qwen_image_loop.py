"""The Qwen-Image text-to-image loop: text_encode (Qwen2.5-VL) -> denoise x N -> vae_decode.

An image loop (fvgraph/loops/image_loop.py: a one-frame video, the shifted image schedule, true CFG)
that reads its text as diffusers' QwenImagePipeline does: each text wrapped in the pipeline's prompt
template, Qwen2.5-VL's last hidden state over the text's own tokens with the template's system
prompt dropped, cut at the request's `max_sequence_length`. Texts differ in length, so the two texts
of a request are zero-padded to one length (the longer, rounded up to TEXT_BUCKET tokens so that
requests share step signatures) with a padding mask the denoiser attends by: a request-constant
input of the step. The combined true-CFG prediction is rescaled to the cond prediction's norm, and
the VAE's latents_mean / latents_std are undone before decoding (VaeDecodeStep, as Wan's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.plan import StepResult
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.image_loop import ImageLoop, image_denoise_kind
from fvgraph.loops.qwen_image_steps import QwenImageDenoiseStep, QwenTextEncodeStep
from fvgraph.loops.steps import VaeDecodeStep
from fvgraph.loops.t2v_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE, VAE_DECODE, T2VState
from fvgraph.loops.t2v_state_check import EMBED_SLOTS
from fvgraph.loops.taps import TapPoints
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


def qwen_denoise_kind(name: str, cfg: bool) -> StepKind:
    """Latents, timestep and Euler row per step; the texts, their masks and the true-CFG scale constant."""
    texts = ("prompt_embeds", "prompt_embeds_mask")
    if cfg:
        texts += ("negative_prompt_embeds", "negative_prompt_embeds_mask", "guidance_scale")
    return image_denoise_kind(name, texts)


STEP_KINDS = {
    TEXT_ENCODE: StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                          inputs={"input_ids": Role.STEP, "attention_mask": Role.STEP}, outputs={"embeds": Role.RESULT}),
    DENOISE: qwen_denoise_kind(DENOISE, cfg=False),
    DENOISE_CFG: qwen_denoise_kind(DENOISE_CFG, cfg=True),
    VAE_DECODE: StepKind(VAE_DECODE, component="vae", phase="vae_decode", inputs={"latents": Role.STEP},
                         outputs={"video": Role.RESULT}),
}  # fmt: skip


@dataclass
class QwenImageState(T2VState):
    """T2VState plus the texts' padding masks; `guidance_scale` is the true-CFG scale, `latents` are
    [1, C, 1, h, w]. Until text encoding ends each text keeps its own length; then both are cut at
    `max_sequence_length` and padded to one (a multiple of TEXT_BUCKET)."""

    prompt_embeds_mask: torch.Tensor | None = None  # [1, L] int64, 1 for the text's tokens
    negative_prompt_embeds_mask: torch.Tensor | None = None
    max_sequence_length: int = 0  # the request's: text tokens past it are cut, as QwenImagePipeline.encode_prompt


class QwenImageLoop(ImageLoop):
    loop_id = "qwen_image"
    state_type = QwenImageState
    step_kinds = STEP_KINDS
    device_fields = (*ImageLoop.device_fields, "prompt_embeds_mask", "negative_prompt_embeds_mask")
    text_fields = ("prompt_embeds_mask", "negative_prompt_embeds_mask", "max_sequence_length")

    def __init__(self, card: ModelCard, components: Components):
        super().__init__(card, components)
        # The step passes no guidance: diffusers' Qwen-Image timestep embedding takes none (its
        # `guidance_embeds` path is unfinished there), so guidance_scale is refused whatever the config says.
        self.guidance_embeds = False

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]:
        c = self.components
        tap_points = TapPoints(c.transformer) if taps else None
        steps = {kind: QwenImageDenoiseStep(c.transformer, self.sampler, cfg, self.spatial_scale, tap_points)
                 for kind, cfg in ((DENOISE, False), (DENOISE_CFG, True))}  # fmt: skip
        steps[VAE_DECODE] = VaeDecodeStep(c.vae)
        if c.text_encoder is not None:
            steps[TEXT_ENCODE] = QwenTextEncodeStep(c.text_encoder)
        return {kind: step.to(c.device).eval() for kind, step in steps.items()}

    def warmup_request(self, num_frames: int, height: int, width: int, guidance_scale: float, steps: int) -> Request:
        cfg = guidance_scale > 1
        if self.components.text_encoder is not None:
            text = {"prompt": "warmup", **({"negative_prompt": " "} if cfg else {})}
        else:
            embeds = torch.zeros(TEXT_BUCKET, self.facts.text_dim)
            text = {"prompt_embeds": embeds, **({"negative_prompt_embeds": embeds} if cfg else {})}
        return Request(**text, true_cfg_scale=guidance_scale, num_inference_steps=steps, height=height, width=width, seed=0)

    # -- init ------------------------------------------------------------------------------------------

    def _conditioning(self, request: Request, latents: torch.Tensor) -> dict:
        masks = {}
        for embeds, mask in MASKS.items():
            given = getattr(request, embeds)
            if given is not None and (embeds == "prompt_embeds" or request.do_cfg):
                # No mask given: every token is attended to, as QwenImagePipeline takes embeddings without one.
                value = getattr(request, mask)
                masks[mask] = (torch.ones(given.shape[0], dtype=torch.int64) if value is None else value).view(1, -1)
        return {**masks, "max_sequence_length": int(request.max_sequence_length)}

    def _padded(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """[L, D] user embeddings -> [1, L, D]; cut and padded with the other text once both are known."""
        return None if embeds is None else embeds.unsqueeze(0).to(self.components.device, self.embed_dtype)

    def _tokenize(self, state: QwenImageState, request: Request, texts: list[tuple[str, str]]) -> None:
        tokens = self.components.tokenizer([PROMPT_TEMPLATE.format(text) for _, text in texts], padding=True, truncation=True,
                                           max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_DROP, return_tensors="pt")  # fmt: skip
        state.input_ids, state.attention_mask = tokens.input_ids, tokens.attention_mask

    def _phase_after_text(self, state: QwenImageState) -> str:
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
        return "denoise"

    # -- next / advance -----------------------------------------------------------------------------

    def _conditioning_inputs(self, state: QwenImageState) -> dict[str, torch.Tensor]:
        inputs = {"prompt_embeds_mask": state.prompt_embeds_mask}
        if state.cfg:
            inputs["negative_prompt_embeds_mask"] = state.negative_prompt_embeds_mask
        return inputs

    def advance(self, state: QwenImageState, result: StepResult) -> QwenImageState:
        if state.phase != "encode":
            return super().advance(state, result)
        embeds = result["embeds"]
        for row, slot in enumerate(state.encode_slots):
            # QwenImagePipeline._extract_masked_hidden, then e[drop_idx:]: the row's tokens after the system prompt.
            tokens = state.attention_mask[row].bool().nonzero().squeeze(1).to(embeds.device)
            kept = embeds[row].index_select(0, tokens)[TEMPLATE_DROP:].to(self.embed_dtype)
            setattr(state, slot, kept.unsqueeze(0))
            setattr(state, MASKS[slot], torch.ones(1, kept.shape[0], dtype=torch.int64))
        state.input_ids = state.attention_mask = None
        state.encode_slots = []
        state.phase = self._phase_after_text(state)
        return state

    def check_saved_text(self, checker, state: QwenImageState) -> None:
        """Token ids as _tokenize makes them; each text in the denoiser's dtype beside its 0/1 mask, both
        texts at one length once encoding ended."""
        text_len = self.card.shapes.text_len
        msl = state.max_sequence_length
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= text_len:
            checker.fail("max_sequence_length", f"must be an int in [1, {text_len}], got {msl!r}")
        needed = list(EMBED_SLOTS[: 2 if state.cfg else 1])
        if state.phase == "encode":
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
            if embeds.shape[0] != 1 or embeds.shape[2] != self.facts.text_dim or not 1 <= embeds.shape[1] <= text_len:
                checker.fail(name, f"must be [1, L <= {text_len}, {self.facts.text_dim}], got {list(embeds.shape)}")
            if embeds.dtype != self.embed_dtype:
                checker.fail(name, f"must be {self.embed_dtype}, got {embeds.dtype}")
            mask = checker.tensor(MASKS[name], shape=(1, embeds.shape[1]), floating=False)
            if mask.dtype != torch.int64 or not ((mask == 0) | (mask == 1)).all():
                checker.fail(MASKS[name], f"must be int64 0/1, got {mask.dtype}")
            lengths.add(embeds.shape[1])
        if state.phase != "encode" and len(lengths) > 1:
            checker.fail("negative_prompt_embeds", f"must be as long as prompt_embeds once encoded, got lengths {sorted(lengths)}")
