"""The family-neutral denoise loop: text_encode -> (media encode) -> denoise x N -> vae_decode.

    loop = DenoiseLoop(card, components, family_parts, LoopConfig(...))

A family supplies its parts (fvgraph/loops/loop_parts.py: text conditioning, the denoiser, the latents'
schedule, media conditioning, the decoder); the deployment's strategies (step caching, adapters,
rollouts) are parts the loop builds from its LoopConfig. The loop itself is host-side bookkeeping
only: it draws the initial noise, plans the sampler's coefficients once, hands out one WorkPlan at a
time and folds each step's tensors back into the request's state. Wan's, FLUX's and Qwen-Image's
loops are this class with their parts (t2v_loop.py, flux_loop.py, qwen_image_loop.py, ...).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from fvgraph.behavior import BehaviorRecord
from fvgraph.caching.methods import caching_step_kinds, caching_steps, warmup_variants
from fvgraph.card import ModelCard
from fvgraph.contract.denoise_update import carry_names
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import Done, ShapeSignature, StepResult, WorkPlan
from fvgraph.contract.step_kind import StepKind
from fvgraph.loops.denoise_state import DenoiseFacts, DenoiseState, to_device
from fvgraph.loops.loop_adapters import LoopAdapters
from fvgraph.loops.loop_parts import FAMILY_FIELDS, FamilyParts, LoopConfig
from fvgraph.loops.previews import LoopPreviews
from fvgraph.loops.result_artifacts import artifacts
from fvgraph.loops.loop_rollouts import SDE_KINDS, LoopRollouts, rollout_step_kinds
from fvgraph.loops.samplers import SamplerPlan, build_sampler, start_step
from fvgraph.loops.state_check import check_state
from fvgraph.loops.step_caching import StepCaching
from fvgraph.loops.taps import TapPoints
from fvgraph.loops.tiled_coding import VAE_DECODE, Decoding, TiledEncoding
from fvgraph.models.components import Components
from fvgraph.models.vae_tiles import vae_tiling
from fvgraph.events import DecodedFrames, PreviewEvent
from fvgraph.request import Request, RequestRejected, Result

TEXT_ENCODE = "text_encode"
DENOISE, DENOISE_CFG = "denoise", "denoise_cfg"  # a family's plain denoise kinds, without and with CFG
# Looked up once: next() and advance() compare a phase per request per step.
_ENCODE, _DENOISE, _DECODE = Phase.ENCODE, Phase.DENOISE, Phase.DECODE


class DenoiseLoop:
    """init / next / advance / finalize for one card's loop; holds no per-request state."""

    def __init__(self, card: ModelCard, components: Components, parts: FamilyParts, config: LoopConfig | None = None):
        config = config or LoopConfig()
        self.card, self.components, self.parts = card, components, parts
        self.loop_id, self.state_type = parts.loop_id, parts.state_type
        self.text, self.denoiser, self.latents, self.conditioning = parts.text, parts.denoiser, parts.latents, parts.conditioning
        self.facts = components.facts  # read from the weights' configs, not the card
        self.sampler = build_sampler(card.recipe.sampler)
        self.latent_channels, self.temporal_scale, self.spatial_scale = self.facts.latent_channels, self.facts.vae_temporal, self.facts.vae_spatial
        # The denoiser's dtype as diffusers reports it: its first parameter may be one kept in fp32
        # (from_pretrained loads scale_shift_table first), which is not the dtype it runs in.
        self.embed_dtype = components.transformer.dtype
        self.sections = parts.denoiser.sections(components.transformer)  # what step caching runs on (None: nothing)
        self.projection_layout = parts.projection_layout  # how the eager path reuses text projections (None: it does not)
        self.pre_denoise_phases = () if parts.conditioning is None else parts.conditioning.phases
        self.device_fields = ("latents", "fresh_noise", "prompt_embeds", "negative_prompt_embeds", *parts.text.device_fields,
                              *(() if parts.conditioning is None else parts.conditioning.device_fields))  # fmt: skip
        refused = parts.caching_refused
        if self.sections is None:
            refused = f"card {card.card_id!r} runs loop {self.loop_id!r}, which has no step caching yet"
        self.caching = StepCaching(card, components, self.sections, refused, config.step_caching_methods, config.calibration,
                                   self._denoise_steps)  # fmt: skip
        self.adapters = LoopAdapters(config.adapters, components.device)
        self.rollouts = LoopRollouts(card, config.run_facts) if parts.rollouts else None
        self.run_facts = dict(config.run_facts)  # opt level and parallel plan, for the artifacts' provenance
        tiling = None if components.vae is None else vae_tiling(components.vae, config.vae_tiling)
        self.decoding = Decoding(parts.decoder, tiling, components.vae)
        # A media conditioning's VAE encode, in tiles as the decode (None: untiled, or no media encode).
        self.encoding = TiledEncoding(tiling) if tiling is not None and parts.conditioning is not None else None
        self.step_kinds = self._declared_kinds()
        self.previews = LoopPreviews(card, components, lambda: self.decoding.build(components)[VAE_DECODE])
        self.reads = parts.reads  # the family-specific Request fields it reads (loop_parts.FAMILY_FIELDS); it refuses the others
        self._signatures: dict[ShapeSignature, ShapeSignature] = {}

    @property
    def step_caching_methods(self) -> tuple[str, ...]:
        """The step-caching methods a request may pick here: the deployment's, none where the loop refuses caching."""
        return self.caching.methods if self.caching.refused is None else ()

    def _declared_kinds(self) -> dict[str, StepKind]:
        p = self.parts
        kinds = {TEXT_ENCODE: p.text.kind, **p.denoiser.step_kinds, **self.decoding.step_kinds}
        if p.conditioning is not None:
            kinds.update(p.conditioning.step_kinds)
            if self.encoding is not None:
                kinds.update(self.encoding.step_kinds)
        if p.denoiser.teacache_signal is not None:  # a request with step caching (fvgraph/caching/)
            kinds.update(caching_step_kinds(p.denoiser.kinds, p.denoiser.teacache_signal))
        if p.rollouts:  # a rollout request (fvgraph/behavior.py)
            kinds.update(rollout_step_kinds(p.denoiser.kinds))
        return kinds

    # -- steps -------------------------------------------------------------------------------------

    def build_steps(self, taps: bool = False) -> dict[str, nn.Module]:
        """One step module per step kind; they share the components' modules (no weight copies).
        With `taps` the denoise steps are the parity tap variants."""
        c = self.components
        # One set of tap hooks per denoiser, shared by every step that calls it: a second set would
        # count each block's calls twice.
        tap_points = functools.cache(TapPoints) if taps else lambda transformer: None
        steps = {**self.denoiser.steps(c, self.sampler, tap_points), **self.decoding.build(c)}
        if self.sections is not None:
            steps.update(caching_steps(self.sections, self.sampler))
        if self.rollouts is not None:
            # the family's denoise steps on the SDE sampler, built as its denoise steps are (the same taps)
            steps.update(self.rollouts.steps(self.denoiser.steps(c, self.rollouts.sampler, tap_points), self.denoiser.kinds))
        if self.conditioning is not None:
            steps.update(self.conditioning.build(c))
            if self.encoding is not None:
                steps.update(self.encoding.build(steps))
        if c.text_encoder is not None:
            steps[TEXT_ENCODE] = self.text.build(c)
        return {kind: c.place(step).eval() for kind, step in steps.items()}  # offloaded parts stay in host memory

    def _denoise_steps(self, transformer: nn.Module) -> dict[str, nn.Module]:
        """The first expert's denoise steps on `transformer` (a data-free twin, for step caching's FLOPs)."""
        plain = {kind.name: self.denoiser.step(transformer, self.sampler, cfg, None) for cfg, kind in self.denoiser.kinds.items()}
        sections = self.denoiser.sections(transformer)
        return {**plain, **(caching_steps(sections, self.sampler) if sections is not None else {})}

    # -- requests ----------------------------------------------------------------------------------

    def check_request(self, request: Request) -> Request:
        """`request` with the card's defaults filled in, checked against the card, the family's parts and
        the loaded weights (RequestRejected naming the field); text needs the text encoder."""
        self._check_family_fields(request)
        self.latents.check(request)
        resolved = self.caching.deployed_default(request).resolve(self.card, self.facts)
        check_text_encoder(resolved, self.components)
        self.denoiser.check(resolved)
        self.text.check(resolved)
        if self.conditioning is not None:
            self.conditioning.check(resolved)
        resolved = self.caching.check(resolved)
        if resolved.rollout is not None and self.rollouts is None:
            raise RequestRejected("rollout", f"card {self.card.card_id!r} runs loop {self.loop_id!r}: rollouts run on "
                                             "single-expert text-to-video loops")  # fmt: skip
        self.adapters.choice(resolved)
        self.previews.check(resolved)
        return resolved

    def _check_family_fields(self, request: Request) -> None:
        """A field only other families read is refused, naming it: it would be silently ignored here."""
        reads = self.reads
        for name in FAMILY_FIELDS:
            value = getattr(request, name)
            if value is None or name in reads or (name == "max_sequence_length" and value == self.card.shapes.text_len):
                continue
            raise RequestRejected(name, f"card {self.card.card_id!r} runs loop {self.loop_id!r}, which takes no {name}; "
                                        "leave it unset")  # fmt: skip

    def warmup_request(self, num_frames: int, height: int, width: int, guidance_scale: float, steps: int) -> Request:
        """A request that runs every step kind of this loop at this shape (what `fvgraph warmup` serves)."""
        media = {} if self.conditioning is None else self.conditioning.warmup_inputs(height, width)
        return Request(**self.text.warmup_text(guidance_scale, self.components.text_encoder is not None),
                       **self.denoiser.warmup_guidance(guidance_scale), **self.latents.warmup_frames(num_frames),
                       num_inference_steps=steps, height=height, width=width, seed=0, **media)  # fmt: skip

    def warmup_variants(self, plan: WorkPlan) -> list[WorkPlan]:
        """The kinds a step-caching method may run in `plan`'s place."""
        return warmup_variants(plan)

    # -- init ------------------------------------------------------------------------------------

    def planned(self, num_steps: int, state: Request | DenoiseState, start: int = 0) -> SamplerPlan:
        """The schedule a request (or a saved state) runs, steps `start`..`num_steps`-1 of `num_steps`:
        a rollout's SDE schedule, else the family's."""
        noise_level = _noise_level(state)
        if noise_level is not None:
            return self.rollouts.planned(num_steps, noise_level)
        if isinstance(state, Request):
            hw = (state.height // self.spatial_scale, state.width // self.spatial_scale)
        else:
            hw = tuple(state.latents.shape[-2:])
        return self.latents.planned(self.sampler, num_steps, hw, start)

    def sampler_of(self, state: Request | DenoiseState):
        """The sampler a request (or its state) runs: the SDE one for a rollout, else the card's."""
        return self.sampler if _noise_level(state) is None else self.rollouts.sampler

    def init(self, request: Request) -> DenoiseState:
        """`request` must already be resolved against this card (defaults filled, rules checked)."""
        device = self.components.device
        start = 0 if request.strength is None else start_step(request.num_inference_steps, request.strength)
        plan, sampler = self.planned(request.num_inference_steps, request, start), self.sampler_of(request)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        latents = to_device(self._initial_noise(request, generator), device)
        media = {} if self.conditioning is None else self.conditioning.init_fields(request, latents)
        state = self.state_type(
            request_id=request.request_id,
            card_id=self.card.card_id,
            seed=request.seed,
            cfg=request.do_cfg,
            guidance_scale=float(getattr(request, self.card.recipe.cfg_scale)),  # the CFG combine's scale
            output_type=request.output_type,
            phase=Phase.ENCODE,
            step_index=0,
            timesteps=plan.timesteps,
            coeffs=plan.coeffs,
            schedule_start=start,
            latents=latents,
            carry=list(sampler.initial_carry(latents)),
            prompt_embeds=self.text.given(request.prompt_embeds),
            negative_prompt_embeds=self.text.given(request.negative_prompt_embeds) if request.do_cfg else None,
            weights_version=self.components.weights_version,
            adapters=self.adapters.choice(request),
            rollout=None if request.rollout is None else LoopRollouts.start(request.rollout.noise_level, latents),
            preview_every=request.preview_every,
            **self.text.init_fields(request),
            **self.denoiser.init_fields(request),
            **media,
        )
        if sampler.draws_noise:  # the same generator goes on: the recipes draw it in this order
            state.generator_state = generator.get_state()
            self._draw_fresh_noise(state)
        self.caching.start(state, request)
        texts = _texts_to_encode(state, request)
        if texts:
            self.text.tokenize(state, request, texts)
            state.encode_slots = [slot for slot, _ in texts]
        else:  # every text came as embeddings
            self._texts_known(state)
        return state

    def _texts_known(self, state: DenoiseState) -> None:
        self.text.finish(state)
        first = None if self.conditioning is None else self.conditioning.first_phase(state)
        state.phase = Phase.DENOISE if first is None else first

    def _initial_noise(self, request: Request, generator: torch.Generator) -> torch.Tensor:
        """Drawn on a CPU generator, so a seed gives the same noise on any device (as diffusers with a CPU generator)."""
        shape = (1, self.latent_channels, (request.num_frames - 1) // self.temporal_scale + 1,
                 request.height // self.spatial_scale, request.width // self.spatial_scale)  # fmt: skip
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    def _draw_fresh_noise(self, state: DenoiseState) -> None:
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

    # -- next / advance ----------------------------------------------------------------------------

    def next(self, state: DenoiseState) -> WorkPlan | Done:
        phase = state.phase
        if phase == _DENOISE:  # first: every step but a few is one (this runs per request per step)
            if state.derived is not None and self.denoiser.changes_kind(state):
                state.derived = None  # crossing an expert boundary: the other expert's facts from here on
            facts = state.derived or self._denoise_facts(state)
            i = state.step_index
            inputs = {"latents": state.latents, "timestep": facts.timesteps[i], "coeffs": facts.coeffs[i], **facts.constants}
            inputs.update(zip(facts.carry_names, state.carry))
            if state.fresh_noise is not None:
                inputs["fresh_noise"] = state.fresh_noise
            places = self.adapters.places(state, self.step_kinds[facts.kind].component)
            if state.caching is not None:
                state.derived = facts  # its signature stays unset: a cached step's kind and inputs vary
                return self.caching.plan(state, facts, inputs, self._signatures, places)
            plan = WorkPlan(state.request_id, facts.kind, inputs, i, facts.pixels, facts.signature, places)
            if facts.signature is None:  # the first step; every later one has the same input shapes
                # One object per distinct signature: grouping and graph lookups then match by identity.
                plan.signature = self._signatures.setdefault(plan.signature, plan.signature)
                state.derived = facts._replace(signature=plan.signature)
            return plan
        if phase == _ENCODE:
            return WorkPlan(state.request_id, TEXT_ENCODE, self.text.encode_inputs(state))
        if phase == _DECODE:
            return self.decoding.plan(state)
        if phase in self.pre_denoise_phases:
            plan = self.conditioning.plan(state)
            return plan if self.encoding is None else self.encoding.plan(state, plan)
        return Done()

    def _denoise_facts(self, state: DenoiseState) -> DenoiseFacts:
        """What every denoise step of a request shares (until an expert boundary), worked out at its first
        one: the schedule as per-step views of one device tensor (no per-step slicing or host-to-device
        copy) and the inputs that never change."""
        device = self.components.device
        constants = {"prompt_embeds": state.prompt_embeds}
        if state.cfg:
            constants["negative_prompt_embeds"] = state.negative_prompt_embeds
            constants["guidance_scale"] = torch.tensor([state.guidance_scale], dtype=torch.float32, device=device)
        constants.update(self.text.constants(state))
        constants.update(self.denoiser.constants(state))
        if self.conditioning is not None:
            constants.update(self.conditioning.constants(state))
        _, _, frames, h, w = state.latents.shape
        pixels = ((frames - 1) * self.temporal_scale + 1, h * self.spatial_scale, w * self.spatial_scale)
        kind = self.denoiser.kinds[state.cfg].name if state.rollout is None else SDE_KINDS[state.cfg]
        kind, constants = self.denoiser.at_step(state, kind, constants)
        constants.update(self.adapters.rows(state, self.step_kinds[kind].component))  # the rows of this kind's expert
        timesteps, coeffs = to_device(state.timesteps, device).split(1), to_device(state.coeffs, device).split(1)
        return DenoiseFacts(kind, timesteps, coeffs, constants, pixels, carry_names(len(state.carry)), signature=None)

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        phase = state.phase
        if phase == _DENOISE:
            if state.caching is not None and not self.caching.advance(state, result):
                return state  # the first of the step's two launches ran (FBCache)
            before, noise = state.latents, state.fresh_noise  # what a preview's x0 is solved from
            state.latents = result["latents"]
            state.carry = [result[name] for name in state.derived.carry_names]  # set by next()
            if state.rollout is not None:
                LoopRollouts.record(state, result)
            state.step_index += 1
            if state.fresh_noise is not None and state.step_index < state.num_steps:
                self._draw_fresh_noise(state)
            carry = state.carry
            if state.step_index == state.num_steps:
                self._after_last_step(state)
            if state.preview_every is not None:
                self.previews.after_step(state, self.sampler_of(state), before, carry, noise)
        elif phase == _ENCODE:
            self.text.take_encoded(state, result)
            state.input_ids = state.attention_mask = None
            state.encode_slots = []
            self._texts_known(state)
        elif phase == _DECODE:
            self.decoding.take(state, result)  # one tile of a tiled decode, or the whole decode
            if state.decoded is not None:
                state.phase = Phase.DONE
        elif phase in self.pre_denoise_phases:
            if self.encoding is not None:
                result = self.encoding.take(state, result)  # None: a tile of a tiled encode
            if result is not None:
                self.conditioning.take(state, result)
        return state

    def _after_last_step(self, state: DenoiseState) -> None:
        # History, noise, kept tensors and derived values are dead weight once the last step ran.
        state.carry, state.fresh_noise = [], None
        if state.caching is not None:
            state.caching.end()
        if self.conditioning is not None:
            self.conditioning.after_last_step(state)
        state.derived = None
        state.phase = Phase.DECODE if state.output_type == "np" else Phase.DONE

    @staticmethod
    def take_preview(state: DenoiseState) -> PreviewEvent | None:
        """The preview the last step made for this request (Request.preview_every), once; else None."""
        preview, state.preview = state.preview, None
        return preview

    def take_frames(self, state: DenoiseState) -> DecodedFrames | None:
        """The frames the last decode step made final for this request, once, in order; else None."""
        if state.new_frames is None:
            return None
        (start, pixels), state.new_frames = state.new_frames, None
        total = (state.latents.shape[2] - 1) * self.temporal_scale + 1
        return DecodedFrames(state.request_id, start, to_frames(pixels), total)

    def finalize(self, state: DenoiseState) -> Result:
        frames = None if state.decoded is None else to_frames(state.decoded)
        latents, provenance = state.latents.cpu(), self._provenance(state)
        return Result(
            request_id=state.request_id,
            status="ok",
            seed=state.seed,
            frames=frames,
            latents=latents,
            timings=dict(state.timings),
            cache=None if state.caching is None else state.caching.report(),
            provenance=provenance,
            record=self._behavior_record(state),
            artifacts=artifacts(self.card, state, provenance, self.run_facts, latents, frames),
        )

    def _provenance(self, state: DenoiseState) -> dict:
        recipe = self.card.recipe
        return {"card_id": self.card.card_id, "weights_version": state.weights_version, "precision": recipe.precision,
                "recipe": {"name": recipe.name, "method": recipe.method, "assumes_precision": recipe.assumes_precision or recipe.precision,
                           **self.card.recipe_in_effect()}, "loras": {} if state.adapters is None else dict(state.adapters.scales),
                "lora_digests": {} if state.adapters is None else dict(state.adapters.digests),
                "merged_loras": self.adapters.merged()}  # fmt: skip

    def _behavior_record(self, state: DenoiseState) -> BehaviorRecord | None:
        if state.rollout is None:
            return None
        from fvgraph.kernels.attention import sdpa_backends

        shape = self.sections.attention_shape({"latents": state.latents, "prompt_embeds": state.prompt_embeds})
        backend = sdpa_backends(*shape, self.components.device)[0].name  # what the denoise steps asked for first
        return self.rollouts.behavior_record(state, self._provenance(state), backend)

    # -- resume ------------------------------------------------------------------------------------

    def adopt(self, state: DenoiseState) -> DenoiseState:
        """A state saved by another engine of the same card, moved onto this loop's device; it
        continues where it stopped. Raises ValueError for a state of another card or sampler."""
        if not isinstance(state, self.state_type):
            raise ValueError(f"loop {self.loop_id!r} resumes a {self.state_type.__name__}, got a {type(state).__name__}")
        # A state from disk is untrusted input: another card, sampler or weights, or any field this
        # loop could not have produced, is refused naming the field and the rule (state_check.py).
        check_state(state, self)
        self.adapters.check_saved(state)
        if self.conditioning is not None:
            self.conditioning.check_saved(state)
        device = self.components.device
        for name in self.device_fields:
            value = getattr(state, name)
            if value is not None:
                setattr(state, name, value.to(device))
        state.carry = [t.to(device) for t in state.carry]
        if state.rollout is not None:
            state.rollout.to(device)
        if state.caching is not None:
            state.caching.to(device)
        state.derived = None  # derived on the other engine's device; rebuilt here on demand
        return state


def to_frames(video: torch.Tensor) -> np.ndarray:
    """Decoded pixels [1, 3, t, H, W] in [0, 1] -> uint8 [t, H, W, 3] (per pixel: a chunk of frames
    converts to exactly what the same frames of the whole video do)."""
    video = video[0].permute(1, 2, 3, 0).float().cpu()
    return (video * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def _texts_to_encode(state: DenoiseState, request: Request) -> list[tuple[str, str]]:
    """(embedding slot, text) of each text still to encode, positive first."""
    texts = []
    if state.prompt_embeds is None:
        texts.append(("prompt_embeds", request.prompt))
    if state.cfg and state.negative_prompt_embeds is None:
        texts.append(("negative_prompt_embeds", request.negative_prompt or ""))
    return texts


def _noise_level(state: Request | DenoiseState) -> float | None:
    """A Request's rollout noise level, or a state's (None: not a rollout)."""
    return None if state.rollout is None else state.rollout.noise_level  # RolloutSampling or RolloutTrace


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

