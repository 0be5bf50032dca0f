"""The FLUX.1 text-to-image loop: text_encode (CLIP pooled + T5) -> denoise x N -> vae_decode.

An image loop (fvgraph/loops/image_loop.py: a one-frame video, the shifted image schedule, true CFG);
what differs from Wan is what diffusers' FluxPipeline does differently: two text encoders (CLIP's
pooled output and T5's sequence, used as given, at the request's `max_sequence_length`) and guidance
as an input of the denoiser where the weights take one (FLUX.1-dev; none for schnell).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fvgraph.caching.methods import caching_step_kinds, caching_steps
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.flux_steps import FluxDenoiseStep, FluxTextEncodeStep, ImageVaeDecodeStep
from fvgraph.loops.image_loop import ImageLoop, image_denoise_kind
from fvgraph.loops.t2v_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE, VAE_DECODE, T2VState
from fvgraph.loops.t2v_state_check import EMBED_SLOTS
from fvgraph.loops.taps import TapPoints
from fvgraph.models.components import Components
from fvgraph.models.flux_sections import FluxSections
from fvgraph.card import ModelCard
from fvgraph.request import Request, RequestRejected


def flux_denoise_kind(name: str, cfg: bool) -> StepKind:
    """Latents, timestep and Euler row per step; the texts, pooled texts, embedded guidance and the
    true-CFG scale constant for the request."""
    texts = ("prompt_embeds", "pooled_prompt_embeds", "guidance")
    if cfg:
        texts += ("negative_prompt_embeds", "negative_pooled_prompt_embeds", "guidance_scale")
    return image_denoise_kind(name, texts)


DENOISE_KINDS = {False: flux_denoise_kind(DENOISE, cfg=False), True: flux_denoise_kind(DENOISE_CFG, cfg=True)}
STEP_KINDS = {
    TEXT_ENCODE: StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                          inputs={"input_ids": Role.STEP, "input_ids_2": Role.STEP},
                          outputs={"pooled": Role.RESULT, "embeds": Role.RESULT}),
    DENOISE: DENOISE_KINDS[False],
    DENOISE_CFG: DENOISE_KINDS[True],
    VAE_DECODE: StepKind(VAE_DECODE, component="vae", phase="vae_decode", inputs={"latents": Role.STEP},
                         outputs={"video": Role.RESULT}),
    **caching_step_kinds(DENOISE_KINDS, FluxSections.teacache_signal),  # a request with step caching (fvgraph/caching/)
}  # fmt: skip
POOLED = {"prompt_embeds": "pooled_prompt_embeds", "negative_prompt_embeds": "negative_pooled_prompt_embeds"}


@dataclass
class FluxState(T2VState):
    """T2VState plus the pooled texts, the T5 ids and the embedded guidance; `guidance_scale` is the
    true-CFG scale and `latents` are [1, C, 1, h, w]."""

    pooled_prompt_embeds: torch.Tensor | None = None  # [1, P]
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    input_ids_2: torch.Tensor | None = None  # [n_texts, max_sequence_length] T5 ids, rows as input_ids
    text_len: int = 0  # the T5 sequence length this request runs
    guidance: float | None = None  # the denoiser's embedded guidance (None: the weights take none)


class FluxLoop(ImageLoop):
    loop_id = "flux"
    state_type = FluxState
    step_kinds = STEP_KINDS
    caches = True
    device_fields = (*ImageLoop.device_fields, "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    text_fields = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds", "max_sequence_length")

    def __init__(self, card: ModelCard, components: Components):
        super().__init__(card, components)
        self.pooled_dim = int(components.transformer.config.pooled_projection_dim)
        self.sections = FluxSections(components.transformer, self.spatial_scale)  # what step caching runs on

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]:
        c = self.components
        steps = {**self._denoise_steps(c.transformer, TapPoints(c.transformer) if taps else None), VAE_DECODE: ImageVaeDecodeStep(c.vae)}
        if c.text_encoder is not None:
            steps[TEXT_ENCODE] = FluxTextEncodeStep(c.text_encoder, c.text_encoder_2)
        return {kind: step.to(c.device).eval() for kind, step in steps.items()}

    def _denoise_steps(self, transformer: nn.Module, tap_points: TapPoints | None = None) -> dict[str, nn.Module]:
        plain = {kind: FluxDenoiseStep(transformer, self.sampler, cfg, self.spatial_scale, tap_points)
                 for kind, cfg in ((DENOISE, False), (DENOISE_CFG, True))}  # fmt: skip
        return {**plain, **caching_steps(FluxSections(transformer, self.spatial_scale), self.sampler)}

    # -- requests ------------------------------------------------------------------------------------

    def check_request(self, request: Request) -> Request:
        resolved = super().check_request(request)
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
        return resolved

    def warmup_request(self, num_frames: int, height: int, width: int, guidance_scale: float, steps: int) -> Request:
        """`guidance_scale` is the embedded guidance (a value of the step, not a kind of it): the request
        runs the one-branch kind, as the card's default does; a true-CFG kind compiles at its first use."""
        if self.components.text_encoder is not None:
            text = {"prompt": "warmup"}
        else:
            text = {"prompt_embeds": torch.zeros(self.card.shapes.text_len, self.facts.text_dim),
                    "pooled_prompt_embeds": torch.zeros(self.pooled_dim)}  # fmt: skip
        guidance = {"guidance_scale": guidance_scale} if self.guidance_embeds else {}
        return Request(**text, **guidance, num_inference_steps=steps, height=height, width=width, seed=0)

    # -- init ------------------------------------------------------------------------------------------

    def _conditioning(self, request: Request, latents: torch.Tensor) -> dict:
        device = self.components.device
        pooled = {name: None if getattr(request, name) is None else getattr(request, name).view(1, -1).to(device, self.embed_dtype)
                  for name in POOLED.values()}  # fmt: skip
        if not request.do_cfg:
            pooled["negative_pooled_prompt_embeds"] = None
        text_len = request.max_sequence_length if request.prompt_embeds is None else request.prompt_embeds.shape[0]
        guidance = float(request.guidance_scale) if self.guidance_embeds else None
        return {**pooled, "text_len": int(text_len), "guidance": guidance}

    def _padded(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """[L, D] user embeddings -> [1, L, D]: FluxPipeline uses them as given (T5 pads with tokens, not zeros)."""
        return None if embeds is None else embeds.unsqueeze(0).to(self.components.device, self.embed_dtype)

    def _tokenize(self, state: FluxState, request: Request, texts: list[tuple[str, str]]) -> None:
        """CLIP ids of each text and T5 ids of its second text (`prompt_2`, else the text itself)."""
        second = {"prompt_embeds": request.prompt_2, "negative_prompt_embeds": request.negative_prompt_2}
        clip, t5 = self.components.tokenizer, self.components.tokenizer_2
        state.input_ids = clip([text for _, text in texts], padding="max_length", max_length=clip.model_max_length,
                               truncation=True, return_tensors="pt").input_ids  # fmt: skip
        state.input_ids_2 = t5([second[slot] or text for slot, text in texts], padding="max_length", max_length=state.text_len,
                               truncation=True, return_tensors="pt").input_ids  # fmt: skip

    # -- next / advance -----------------------------------------------------------------------------

    def next(self, state: FluxState):
        if state.phase == "encode":
            device = self.components.device
            return WorkPlan(state.request_id, TEXT_ENCODE, {"input_ids": state.input_ids.to(device),
                                                             "input_ids_2": state.input_ids_2.to(device)})  # fmt: skip
        return super().next(state)

    def _conditioning_inputs(self, state: FluxState) -> dict[str, torch.Tensor]:
        inputs = {"pooled_prompt_embeds": state.pooled_prompt_embeds}
        if state.cfg:
            inputs["negative_pooled_prompt_embeds"] = state.negative_pooled_prompt_embeds
        if state.guidance is not None:
            inputs["guidance"] = torch.tensor([state.guidance], dtype=torch.float32, device=self.components.device)
        return inputs

    def advance(self, state: FluxState, result: StepResult) -> FluxState:
        if state.phase != "encode":
            return super().advance(state, result)
        embeds, pooled = result["embeds"].to(self.embed_dtype), result["pooled"].to(self.embed_dtype)
        for row, slot in enumerate(state.encode_slots):
            setattr(state, slot, embeds[row : row + 1])
            setattr(state, POOLED[slot], pooled[row : row + 1])
        state.input_ids = state.input_ids_2 = None
        state.encode_slots = []
        state.phase = self._phase_after_text(state)
        return state

    def check_saved_text(self, checker, state: FluxState) -> None:
        """Token ids as _tokenize makes them, and each text as a T5 sequence at the request's own length
        beside its CLIP pooled vector, in the denoiser's dtype."""
        if isinstance(state.text_len, bool) or not isinstance(state.text_len, int) or not 1 <= state.text_len <= self.card.shapes.text_len:
            checker.fail("text_len", f"must be an int in [1, {self.card.shapes.text_len}], got {state.text_len!r}")
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
            for field, shape in ((name, (1, state.text_len, self.facts.text_dim)), (POOLED[name], (1, self.pooled_dim))):
                value = checker.tensor(field, shape=shape)
                if value.dtype != self.embed_dtype:
                    checker.fail(field, f"must be {self.embed_dtype}, got {value.dtype}")
