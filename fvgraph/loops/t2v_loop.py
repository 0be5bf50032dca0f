"""The text-to-video loop of Wan-class models: text_encode -> denoise x N -> vae_decode.

Each phase is a step kind of its own (see steps.py), declared in STEP_KINDS for the runtime. The
loop is host-side bookkeeping only: it tokenizes, draws the initial noise, plans the sampler's
coefficients once, hands out one WorkPlan at a time and folds each step's tensors back into the
request's T2VState.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from torch import nn

from fvgraph.adapters.registry import AdapterChoice
from fvgraph.adapters.slots import ROW_INPUTS
from fvgraph.card import ModelCard
from fvgraph.caching.calibration_store import CalibrationStore
from fvgraph.caching.methods import METHODS, caching_step_kinds, caching_steps, load_state
from fvgraph.caching.state import StepCachingState
from fvgraph.contract.denoise_update import carry_names
from fvgraph.contract.loop import SerializableState
from fvgraph.contract.plan import Done, ShapeSignature, StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.samplers import MAX_CARRY, build_sampler
from fvgraph.loops.loop_adapters import LoopAdapters
from fvgraph.loops.loop_rollouts import DENOISE_SDE, DENOISE_SDE_CFG, LoopRollouts, rollout_step_kinds
from fvgraph.loops.step_caching import StepCaching
from fvgraph.loops.step_flops import StepFlops
from fvgraph.loops.steps import DenoiseStep, TextEncodeStep, VaeDecodeStep
from fvgraph.loops.t2v_state_check import check_t2v_state, check_text
from fvgraph.loops.taps import TapPoints
from fvgraph.models.components import Components
from fvgraph.models.wan_sections import WanSections
from fvgraph.request import Request, RequestRejected, Result

TEXT_ENCODE, DENOISE, DENOISE_CFG, VAE_DECODE = "text_encode", "denoise", "denoise_cfg", "vae_decode"
# Inputs every denoise step of a request takes alike (DenoiseStep's arguments): a loop that adds
# conditioning passes some of these constants (i2v: condition, image_embeds; ti2v: first_frame, frame_mask).
CONDITIONING = ("condition", "image_embeds", "first_frame", "frame_mask")
# Request text fields of the image pipelines (FLUX's second encoder and pooled text, Qwen-Image's masks).
IMAGE_TEXT_FIELDS = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds",
                     "prompt_embeds_mask", "negative_prompt_embeds_mask")  # fmt: skip


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
STEP_KINDS = {
    TEXT_ENCODE: StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                          inputs={"input_ids": Role.STEP, "attention_mask": Role.STEP}, outputs={"embeds": Role.RESULT}),
    DENOISE: DENOISE_KINDS[False],
    DENOISE_CFG: DENOISE_KINDS[True],
    VAE_DECODE: StepKind(VAE_DECODE, component="vae", phase="vae_decode", inputs={"latents": Role.STEP},
                         outputs={"video": Role.RESULT}),
    **caching_step_kinds(DENOISE_KINDS, WanSections.teacache_signal),  # a request with step caching (fvgraph/caching/)
    **rollout_step_kinds(DENOISE_KINDS),  # a rollout request (fvgraph/behavior.py)
}  # fmt: skip


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, the copy not waiting for the device: a blocking copy from pageable
    memory waits for every batch queued on the stream, and this runs while one is (an arrival planned,
    a fresh draw in advance, the engine running ahead). On CUDA it goes through pinned memory."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class DenoiseFacts(NamedTuple):
    """Derived once per request from its state (kept in T2VState.derived, never saved)."""

    kind: str
    timesteps: tuple[torch.Tensor, ...]  # [1] per step, on the device
    coeffs: tuple[torch.Tensor, ...]  # [1, num_coeffs] per step, on the device
    constants: dict[str, torch.Tensor]  # inputs equal at every step: embeddings, guidance scale
    pixels: tuple[int, int, int]  # (frames, height, width) of the video
    carry_names: tuple[str, ...]  # the step's inputs and outputs for the sampler's history
    signature: ShapeSignature | None  # set from the first step's plan


@dataclass
class T2VState(SerializableState):
    """Everything one request needs between steps. Tensors live on CPU or the engine's device."""

    request_id: str
    card_id: str
    seed: int
    cfg: bool
    guidance_scale: float
    output_type: str
    phase: str  # "encode" | "denoise" | "decode" | "done"
    step_index: int
    timesteps: torch.Tensor  # [N] as the diffusers scheduler emits them
    coeffs: torch.Tensor  # [N, num_coeffs] sampler rows
    latents: torch.Tensor  # [1, C, F, h, w] float32
    carry: list[torch.Tensor]  # sampler history
    # A sampler that re-noises (fvgraph/loops/samplers.py FewStepSampler): the current step's draw, and
    # the request's CPU generator state after it, so a saved request draws on where it stopped.
    fresh_noise: torch.Tensor | None = None  # like latents
    generator_state: torch.Tensor | None = None  # uint8, torch.Generator.get_state()
    input_ids: torch.Tensor | None = None  # [n_texts, L] texts still to encode: positive first
    attention_mask: torch.Tensor | None = None
    encode_slots: list[str] = field(default_factory=list)  # which embeds each encoded row becomes
    prompt_embeds: torch.Tensor | None = None  # [1, L, D]
    negative_prompt_embeds: torch.Tensor | None = None
    video: torch.Tensor | None = None  # [1, 3, F, H, W] in [0, 1]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step kind, kept across resume
    weights_version: str = ""  # the weights it was started with: resuming on others would mix two models
    # Step caching (fvgraph/caching/): the method's settings, accumulators and kept tensors, or None.
    caching: StepCachingState | None = field(default=None, metadata={"load": load_state})
    # LoRA adapters (fvgraph/adapters/): the request's names, scales and each adapter's digest, or None.
    adapters: AdapterChoice | None = field(default=None, metadata={"load": AdapterChoice.load})
    # A rollout (fvgraph/behavior.py): its SDE noise level, the latents before the first transition and
    # after each, and each transition's log-prob; None and empty otherwise.
    rollout_noise_level: float | None = None
    record_latents: list[torch.Tensor] = field(default_factory=list)
    record_log_probs: list[float] = field(default_factory=list)
    # What next() derives at the first denoise step (on this engine's device); rebuilt after resume.
    derived: DenoiseFacts | None = field(default=None, metadata={"transient": True})

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


class TextToVideoLoop(StepCaching, LoopAdapters, LoopRollouts):
    """init / next / advance / finalize for one card's t2v loop; holds no per-request state."""

    loop_id = "t2v"
    state_type = T2VState
    step_kinds = STEP_KINDS
    pre_denoise_phases: tuple[str, ...] = ()  # phases a subclass adds before the first denoise step
    device_fields = ("latents", "fresh_noise", "prompt_embeds", "negative_prompt_embeds")  # moved by adopt()
    takes_image = False
    text_fields: tuple[str, ...] = ()  # which of IMAGE_TEXT_FIELDS (and max_sequence_length) the loop takes

    def __init__(self, card: ModelCard, components: Components):
        self.card = card
        self.components = components
        self.sampler = build_sampler(card.recipe.sampler)
        self.facts = components.facts  # read from the weights' configs, not the card
        self.temporal_scale = self.facts.vae_temporal
        self.spatial_scale = self.facts.vae_spatial
        self.latent_channels = self.facts.latent_channels
        # The denoiser's dtype as diffusers reports it: its first parameter may be one kept in fp32
        # (from_pretrained loads scale_shift_table first), which is not the dtype it runs in.
        self.embed_dtype = components.transformer.dtype
        self.sections = WanSections(components.transformer)  # what step caching runs on (no weight copy)
        self._signatures: dict[ShapeSignature, ShapeSignature] = {}
        self.calibration = CalibrationStore()  # where calibrated cache settings are found (the engine sets its root)
        self.cache_methods = tuple(METHODS)  # the methods requests may pick (the engine sets the deployment's)
        self._flops: StepFlops | None = None  # built at the first cached request
        self.adapters = None  # the engine's LoRA adapters, an AdapterRegistry (the builder sets it)
        self.run_facts: dict = {}  # opt level and parallel plan, for rollout records (the builder sets them)

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]:
        """One step module per step kind; they share the components' modules (no weight copies).
        With `taps` the denoise steps are the parity tap variants."""
        c = self.components
        steps = {**self._denoise_steps(c.transformer, TapPoints(c.transformer) if taps else None), VAE_DECODE: VaeDecodeStep(c.vae)}
        if c.text_encoder is not None:
            steps[TEXT_ENCODE] = TextEncodeStep(c.text_encoder)
        return {kind: step.to(c.device).eval() for kind, step in steps.items()}

    def _denoise_steps(self, transformer: nn.Module, tap_points: TapPoints | None = None) -> dict[str, nn.Module]:
        return {
            DENOISE: DenoiseStep(transformer, self.sampler, cfg=False, tap_points=tap_points),
            DENOISE_CFG: DenoiseStep(transformer, self.sampler, cfg=True, tap_points=tap_points),
            **caching_steps(WanSections(transformer), self.sampler),
            **self._rollout_steps(transformer, tap_points),
        }

    def check_request(self, request: Request) -> Request:
        """`request` with the card's defaults filled in, checked against the card and the loaded
        weights (RequestRejected); text needs the text encoder."""
        resolved = self._deployed_default(request).resolve(self.card, self.facts)
        check_text_encoder(resolved, self.components)
        self._check_text_fields(request)
        if resolved.guidance_scale_2 is not None and len(self.facts.experts) < 2:
            raise RequestRejected("guidance_scale_2", f"card {self.card.card_id!r} has one denoiser expert; it takes guidance_scale only")
        if resolved.image is not None and not self.takes_image:
            raise RequestRejected("image", f"card {self.card.card_id!r} runs loop {self.loop_id!r}, which takes no image")
        resolved = self._check_caching(resolved)
        self._check_rollout(resolved)
        self._adapter_choice(resolved)
        return resolved

    def _check_text_fields(self, request: Request) -> None:
        """The image pipelines' text fields this loop does not take (`text_fields`) are refused; Wan's
        denoiser takes one encoder's sequence at the card's length."""
        for name in IMAGE_TEXT_FIELDS:
            if name not in self.text_fields and getattr(request, name) is not None:
                raise RequestRejected(name, f"card {self.card.card_id!r} runs loop {self.loop_id!r}, which takes no "
                                            f"{name}; leave it unset")  # fmt: skip
        if "max_sequence_length" not in self.text_fields and request.max_sequence_length not in (None, self.card.shapes.text_len):
            raise RequestRejected("max_sequence_length", f"{request.max_sequence_length}: card {self.card.card_id!r} pads "
                                                         f"its text to {self.card.shapes.text_len} tokens; leave it unset")  # fmt: skip

    def warmup_request(self, num_frames: int, height: int, width: int, guidance_scale: float, steps: int) -> Request:
        """A request that runs every step kind of this loop at this shape (what `fvgraph warmup` serves)."""
        text = {"prompt": "warmup"} if self.components.text_encoder is not None else {
            "prompt_embeds": torch.zeros(1, self.facts.text_dim), "negative_prompt_embeds": torch.zeros(1, self.facts.text_dim)}  # fmt: skip
        return Request(**text, guidance_scale=guidance_scale, num_inference_steps=steps, num_frames=num_frames,
                       height=height, width=width, seed=0, **self._warmup_inputs(height, width))  # fmt: skip

    def _warmup_inputs(self, height: int, width: int) -> dict:
        return {}

    # -- init ------------------------------------------------------------------------------------

    def init(self, request: Request) -> T2VState:
        """`request` must already be resolved against this card (defaults filled, rules checked)."""
        device = self.components.device
        plan, sampler = self.planned(request.num_inference_steps, request), self.sampler_of(request)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        latents = to_device(self._initial_noise(request, generator), device)
        state = self.state_type(
            request_id=request.request_id,
            card_id=self.card.card_id,
            seed=request.seed,
            cfg=request.do_cfg,
            guidance_scale=float(request.guidance_scale),
            output_type=request.output_type,
            phase="encode",
            step_index=0,
            timesteps=plan.timesteps,
            coeffs=plan.coeffs,
            latents=latents,
            carry=list(sampler.initial_carry(latents)),
            prompt_embeds=self._padded(request.prompt_embeds),
            negative_prompt_embeds=self._padded(request.negative_prompt_embeds) if request.do_cfg else None,
            weights_version=self.components.weights_version,
            adapters=self._adapter_choice(request),
            rollout_noise_level=None if request.rollout is None else request.rollout.noise_level,
            record_latents=[] if request.rollout is None else [latents.clone()],
            **self._conditioning(request, latents),
        )
        if sampler.draws_noise:  # the same generator goes on: the recipes draw it in this order
            state.generator_state = generator.get_state()
            self._draw_fresh_noise(state)
        self._start_caching(state, request)
        texts = self._texts_to_encode(state, request)
        if texts:
            self._tokenize(state, request, texts)
            state.encode_slots = [slot for slot, _ in texts]
        else:  # every text came as embeddings
            state.phase = self._phase_after_text(state)
        return state

    @staticmethod
    def _texts_to_encode(state: T2VState, request: Request) -> list[tuple[str, str]]:
        """(embedding slot, text) of each text still to encode, positive first."""
        texts = []
        if state.prompt_embeds is None:
            texts.append(("prompt_embeds", request.prompt))
        if state.cfg and state.negative_prompt_embeds is None:
            texts.append(("negative_prompt_embeds", request.negative_prompt or ""))
        return texts

    def _tokenize(self, state: T2VState, request: Request, texts: list[tuple[str, str]]) -> None:
        """`texts` (slot, text) as the text-encode step's inputs on `state`."""
        tokens = self.components.tokenizer(
            [prompt_clean(text) for _, text in texts],
            padding="max_length",
            max_length=self.card.shapes.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        state.input_ids, state.attention_mask = tokens.input_ids, tokens.attention_mask

    def _conditioning(self, request: Request, latents: torch.Tensor) -> dict:
        """Extra state fields a subclass loop derives from the request (none for text-to-video)."""
        return {}

    def _phase_after_text(self, state: T2VState) -> str:
        """The phase that follows text encoding (a subclass loop may insert its own first)."""
        return "denoise"

    def _initial_noise(self, request: Request, generator: torch.Generator) -> torch.Tensor:
        """Drawn on a CPU generator, so a seed gives the same noise on any device (as diffusers with a CPU generator)."""
        shape = (
            1,
            self.latent_channels,
            (request.num_frames - 1) // self.temporal_scale + 1,
            request.height // self.spatial_scale,
            request.width // self.spatial_scale,
        )
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    def _draw_fresh_noise(self, state: T2VState) -> None:
        """The noise step `state.step_index` takes: the generator's next draw, as LightX2V and FastVideo
        draw after each step but the last (which lands on sigma 0 and takes zeros), and Flow-GRPO's SDE
        step at every step."""
        if state.step_index >= state.num_steps - 1 and not self.sampler_of(state).final_draw:
            state.fresh_noise = torch.zeros_like(state.latents)
            return
        generator = torch.Generator("cpu")
        generator.set_state(state.generator_state)
        noise = torch.randn(tuple(state.latents.shape), generator=generator, dtype=torch.float32)
        state.fresh_noise, state.generator_state = to_device(noise, state.latents.device), generator.get_state()

    def _padded(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """[L, D] user embeddings -> [1, text_len, D], zero-padded as Wan's own encoder output is."""
        if embeds is None:
            return None
        pad = self.card.shapes.text_len - embeds.shape[0]
        embeds = torch.cat([embeds, embeds.new_zeros(pad, embeds.shape[1])]) if pad else embeds
        return embeds.unsqueeze(0).to(self.components.device, self.embed_dtype)

    # -- next / advance ----------------------------------------------------------------------------

    def next(self, state: T2VState) -> WorkPlan | Done:
        phase = state.phase
        if phase == "denoise":  # first: every step but a few is one (this runs per request per step)
            facts = state.derived or self._denoise_facts(state)
            i = state.step_index
            inputs = {"latents": state.latents, "timestep": facts.timesteps[i], "coeffs": facts.coeffs[i], **facts.constants}
            inputs.update(zip(facts.carry_names, state.carry))
            if state.fresh_noise is not None:
                inputs["fresh_noise"] = state.fresh_noise
            if state.caching is not None:
                state.derived = facts  # its signature stays unset: a cached step's kind and inputs vary
                return self._cached_plan(state, facts, inputs)
            plan = WorkPlan(state.request_id, facts.kind, inputs, i, facts.pixels, facts.signature)
            if facts.signature is None:  # the first step; every later one has the same input shapes
                # One object per distinct signature: grouping and graph lookups then match by identity.
                plan.signature = self._signatures.setdefault(plan.signature, plan.signature)
                state.derived = facts._replace(signature=plan.signature)
            return plan
        if phase == "encode":
            device = self.components.device
            inputs = {"input_ids": state.input_ids.to(device), "attention_mask": state.attention_mask.to(device)}
            return WorkPlan(state.request_id, TEXT_ENCODE, inputs)
        if phase == "decode":
            return WorkPlan(state.request_id, VAE_DECODE, {"latents": state.latents})
        return Done()

    def _denoise_facts(self, state: T2VState) -> DenoiseFacts:
        """What every denoise step of a request shares, worked out at its first one: the schedule as
        per-step views of one device tensor (no per-step slicing or host-to-device copy) and the
        inputs that never change."""
        device = self.components.device
        constants = {"prompt_embeds": state.prompt_embeds}
        if state.cfg:
            constants["negative_prompt_embeds"] = state.negative_prompt_embeds
            constants["guidance_scale"] = torch.tensor([state.guidance_scale], dtype=torch.float32, device=device)
        constants.update(self._conditioning_inputs(state))
        constants.update(self._adapter_rows(state))
        _, _, frames, h, w = state.latents.shape
        pixels = ((frames - 1) * self.temporal_scale + 1, h * self.spatial_scale, w * self.spatial_scale)
        kind = (DENOISE_SDE_CFG if state.cfg else DENOISE_SDE) if state.rollout_noise_level is not None else DENOISE_CFG if state.cfg else DENOISE
        timesteps, coeffs = to_device(state.timesteps, device).split(1), to_device(state.coeffs, device).split(1)
        return DenoiseFacts(kind, timesteps, coeffs, constants, pixels, carry_names(len(state.carry)), signature=None)

    def _conditioning_inputs(self, state: T2VState) -> dict[str, torch.Tensor]:
        """Extra request-constant denoise inputs a subclass loop adds (none for text-to-video)."""
        return {}

    def advance(self, state: T2VState, result: StepResult) -> T2VState:
        if state.phase == "encode":
            embeds = result["embeds"].to(self.embed_dtype)
            for row, slot in enumerate(state.encode_slots):
                setattr(state, slot, embeds[row : row + 1])
            state.input_ids = state.attention_mask = None
            state.encode_slots = []
            state.phase = self._phase_after_text(state)
        elif state.phase == "denoise":
            if state.caching is not None and not self._advance_caching(state, result):
                return state  # the first of the step's two launches ran (FBCache)
            state.latents = result["latents"]
            state.carry = [result[name] for name in state.derived.carry_names]  # set by next()
            if state.rollout_noise_level is not None:
                self._record_transition(state, result)
            state.step_index += 1
            if state.fresh_noise is not None and state.step_index < state.num_steps:
                self._draw_fresh_noise(state)
            if state.step_index == state.num_steps:
                state.carry, state.fresh_noise = [], None  # history, noise, kept tensors and derived values are dead weight once the last step ran
                if state.caching is not None:
                    state.caching.end()
                state.derived = None
                state.phase = "decode" if state.output_type == "np" else "done"
        elif state.phase == "decode":
            state.video = result["video"]
            state.phase = "done"
        return state

    def finalize(self, state: T2VState) -> Result:
        frames = None
        if state.video is not None:
            video = state.video[0].permute(1, 2, 3, 0).float().cpu()  # [F, H, W, 3]
            frames = (video * 255).round().clamp(0, 255).to(torch.uint8).numpy()
        return Result(
            request_id=state.request_id,
            status="ok",
            seed=state.seed,
            frames=frames,
            latents=state.latents.cpu(),
            timings=dict(state.timings),
            cache=None if state.caching is None else state.caching.report(),
            provenance=self._provenance(state),
            record=self._behavior_record(state),
        )

    def _provenance(self, state: T2VState) -> dict:
        merged = {} if self.adapters is None else {a.name: a.scale for a in self.adapters.adapters.values() if a.slot is None}
        recipe = self.card.recipe
        return {"card_id": self.card.card_id, "weights_version": state.weights_version, "precision": recipe.precision,
                "recipe": {"name": recipe.name, "method": recipe.method, "assumes_precision": recipe.assumes_precision or recipe.precision,
                           **self.card.recipe_in_effect()}, "loras": {} if state.adapters is None else dict(state.adapters.scales),
                "merged_loras": merged}  # fmt: skip

    def check_saved_text(self, checker, state: T2VState) -> None:
        """A saved state's token ids and embeddings, as init and the text encoder shape them."""
        check_text(checker, state, self.card.shapes.text_len, self.facts.text_dim, self.embed_dtype)

    def adopt(self, state: T2VState) -> T2VState:
        """A state saved by another engine of the same card, moved onto this loop's device; it
        continues where it stopped. Raises ValueError for a state of another card or sampler."""
        if not isinstance(state, self.state_type):
            raise ValueError(f"loop {self.loop_id!r} resumes a {self.state_type.__name__}, got a {type(state).__name__}")
        # A state from disk is untrusted input: another card, sampler or weights, or any field this
        # loop could not have produced, is refused naming the field and the rule (t2v_state_check).
        check_t2v_state(state, self)
        self._check_saved_adapters(state)
        device = self.components.device
        for name in self.device_fields:
            value = getattr(state, name)
            if value is not None:
                setattr(state, name, value.to(device))
        state.carry = [t.to(device) for t in state.carry]
        state.record_latents = [t.to(device) for t in state.record_latents]
        if state.caching is not None:
            state.caching.to(device)
        state.derived = None  # derived on the other engine's device; rebuilt here on demand
        return state



def check_text_encoder(request: Request, components: Components) -> None:
    """An engine built without its text encoder takes embeddings only: a text prompt (or the empty
    negative prompt guidance would encode) is rejected, saying what to pass instead."""
    if components.text_encoder is not None:
        return
    why = "this engine was built without its text encoder (text_encoder=False)"
    if request.prompt is not None:
        raise RequestRejected("prompt", f"{why}: pass prompt_embeds instead of text")
    if request.do_cfg and request.negative_prompt_embeds is None:
        raise RequestRejected(
            "negative_prompt_embeds",
            f"{why}: guidance_scale={request.guidance_scale} > 1 needs negative_prompt_embeds (or guidance_scale <= 1)",
        )
