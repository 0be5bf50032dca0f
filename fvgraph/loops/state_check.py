"""The full check of a DenoiseState (any family's) before it is resumed: a state from disk is untrusted input.

A state another engine saved (or someone edited) must not run, and must never come back "ok", when
it belongs to another card, sampler or set of weights, or when a field holds something the loop
could not have produced: NaN or integer latents, a step index outside the schedule (a negative one
would silently run extra steps), an unknown phase, embeddings of the wrong shape. Each refusal is a
ValueError naming the request, the field and the rule.
"""

from __future__ import annotations

import torch

from fvgraph.caching.settings import NoCache
from fvgraph.caching.state import StepCachingState, TensorLayouts
from fvgraph.contract.loop import Loop, LoopState
from fvgraph.contract.phase import Phase
from fvgraph.loops.samplers import num_coeffs

PHASES = (Phase.ENCODE, Phase.DENOISE, Phase.DECODE, Phase.DONE)
EMBED_SLOTS = ("prompt_embeds", "negative_prompt_embeds")


class _Checker:
    def __init__(self, state: LoopState):
        self.state = state

    def fail(self, name: str, rule: str) -> None:
        raise ValueError(f"state of request {self.state.request_id!r}: {name}: {rule}")

    def tensor(self, name: str, shape: tuple | None = None, dims: int | None = None, floating: bool = True,
               value: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        t = getattr(self.state, name) if value is None else value
        if not isinstance(t, torch.Tensor):
            self.fail(name, f"must be a tensor, got {type(t).__name__}")
        if floating and not t.is_floating_point():
            self.fail(name, f"must be floating point, got {t.dtype}")
        if dims is not None and t.dim() != dims:
            self.fail(name, f"must have {dims} dims, got shape {list(t.shape)}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            self.fail(name, f"must have shape {list(shape)}, got {list(t.shape)}")
        if t.dtype == torch.bool or t.is_complex():
            self.fail(name, f"must hold real numbers, got {t.dtype}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            self.fail(name, "holds NaN or Inf values")
        return t


def check_state(state: LoopState, loop: Loop) -> None:
    """Raise ValueError (request, field, rule) unless `state` is one `loop` could resume correctly."""
    c = _Checker(state)
    card = loop.card
    if state.card_id != card.card_id:
        c.fail("card_id", f"the state belongs to card {state.card_id!r}, not {card.card_id!r}")
    if not state.weights_version:
        c.fail("weights_version", "the state records none (saved before states recorded it), so it cannot be "
                                  "checked against this engine's weights; start the request again")  # fmt: skip
    if state.weights_version != loop.components.weights_version:
        c.fail("weights_version", f"saved with weights {state.weights_version!r}, this engine runs "
                                  f"{loop.components.weights_version!r}: resuming would mix two models")  # fmt: skip
    phases = (*PHASES, *loop.pre_denoise_phases)
    if state.phase not in phases:
        c.fail("phase", f"{str(state.phase)!r} is not one of {', '.join(phases)}")
    if state.output_type not in ("np", "latent"):
        c.fail("output_type", f"{state.output_type!r} must be 'np' or 'latent'")
    if not isinstance(state.guidance_scale, float | int) or not torch.isfinite(torch.tensor(float(state.guidance_scale))):
        c.fail("guidance_scale", "must be a finite number")
    timesteps = c.tensor("timesteps", dims=1, floating=False)  # as the diffusers scheduler emits them (int or float)
    steps = int(timesteps.shape[0])
    if steps < 1:
        c.fail("timesteps", "the schedule is empty")
    if state.rollout is not None and loop.rollouts is None:
        c.fail("rollout", f"loop {loop.loop_id!r} runs no rollouts")
    sampler = loop.sampler_of(state)
    coeffs = c.tensor("coeffs", dims=2)
    if tuple(coeffs.shape) != (steps, num_coeffs(sampler)):
        c.fail("coeffs", f"must be [{steps}, {num_coeffs(sampler)}] (one sampler row per timestep), got {list(coeffs.shape)}")
    start = state.schedule_start
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= 1000:
        c.fail("schedule_start", f"{start!r} must be an int in [0, 1000]: the steps skipped at entry")
    try:  # what init planned: the schedule is the sampler's, never the state's own
        plan = loop.planned(steps + start, state, start)
    except ValueError as error:
        c.fail("schedule_start", str(error))
    for name, value, planned in (("timesteps", timesteps, plan.timesteps), ("coeffs", coeffs, plan.coeffs)):
        if value.dtype != planned.dtype or not torch.equal(value.cpu(), planned):
            c.fail(name, f"is not the card's sampler schedule for {steps} steps from step {start} (reordered or edited)")
    _check_progress(c, state, steps, loop.pre_denoise_phases)
    latents = c.tensor("latents", dims=5)
    if latents.shape[0] != 1 or latents.shape[1] != loop.latent_channels:
        c.fail("latents", f"must be [1, {loop.latent_channels}, frames, h, w], got {list(latents.shape)}")
    _check_carry(c, state, loop)
    _check_fresh_noise(c, state, loop)
    _check_record(c, state, loop)
    loop.text.check_saved(c, state)
    _check_caching(c, state, loop)


def _check_caching(c: _Checker, state: LoopState, loop: Loop) -> None:
    """Complete settings of an active method, and the method's own check of what it keeps."""
    caching = state.caching
    if caching is None:
        return
    if not isinstance(caching, StepCachingState):
        c.fail("caching", f"must be a step-caching state, got {type(caching).__name__}")
    settings = caching.settings
    if isinstance(settings, NoCache) or settings.missing_calibration():  # init stores only complete, active settings
        c.fail("caching.settings", f"must be complete settings of a caching method, got method {settings.method!r} "
                                   f"missing {list(settings.missing_calibration())}")  # fmt: skip
    latents = tuple(state.latents.shape)
    sections, text = loop.sections, state.prompt_embeds
    text_tokens = int(text.shape[1]) if isinstance(text, torch.Tensor) and text.dim() == 3 else 0  # checked before
    condition = getattr(state, "condition", None)  # an edit's image latents (FLUX.1 Kontext's state), checked before
    blocks = sections.hidden_shape(state.latents, text_tokens, condition)
    layouts = TensorLayouts(sections.token_shape(state.latents, condition), sections.token_dtype, latents, blocks)
    caching.check(c.fail, state.cfg, state.phase, layouts)


def _check_progress(c: _Checker, state: LoopState, steps: int, pre_denoise: tuple[str, ...]) -> None:
    index = state.step_index
    if isinstance(index, bool) or not isinstance(index, int):
        c.fail("step_index", f"must be an int, got {type(index).__name__}")
    expected = {"encode": range(0, 1), "denoise": range(0, steps), "decode": range(steps, steps + 1),
                "done": range(steps, steps + 1), **{phase: range(0, 1) for phase in pre_denoise}}[state.phase]  # fmt: skip
    if index not in expected:
        c.fail("step_index", f"{index} is outside [{expected.start}, {expected.stop - 1}] for phase {str(state.phase)!r} "
                             f"of a {steps}-step schedule")  # fmt: skip
    if state.decoded is not None and state.phase != Phase.DONE:
        c.fail("decoded", f"decoded pixels belong to phase 'done', not {str(state.phase)!r}")


def _check_carry(c: _Checker, state: LoopState, loop: Loop) -> None:
    if not isinstance(state.carry, list):
        c.fail("carry", f"must be a list of tensors, got {type(state.carry).__name__}")
    if state.phase in ("decode", "done"):
        return  # the history is dropped after the last step
    expected = loop.sampler_of(state).initial_carry(state.latents)
    if len(state.carry) != len(expected):
        c.fail("carry", f"the sampler keeps {len(expected)} history tensors, the state holds {len(state.carry)}")
    for i, (have, want) in enumerate(zip(state.carry, expected)):
        c.tensor(f"carry[{i}]", shape=tuple(want.shape), value=have)


def _check_fresh_noise(c: _Checker, state: LoopState, loop: Loop) -> None:
    """A re-noising sampler's draw (like the latents, while steps remain) and its generator state."""
    running = loop.sampler_of(state).draws_noise and state.phase not in ("decode", "done")
    for name in ("fresh_noise", "generator_state"):
        if not running and getattr(state, name) is not None:
            c.fail(name, f"must be None: the request's sampler draws no noise in phase {str(state.phase)!r}")
    if not running:
        return
    c.tensor("fresh_noise", shape=tuple(state.latents.shape))
    g = c.tensor("generator_state", dims=1, floating=False)
    try:
        torch.Generator("cpu").set_state(g)
    except (RuntimeError, TypeError) as err:
        c.fail("generator_state", f"is not a CPU generator state ({err})")


def _check_record(c: _Checker, state: LoopState, loop: Loop) -> None:
    """A rollout's record: one latents tensor per transition taken plus the first, one log-prob each."""
    trace = state.rollout
    if trace is None:
        return
    taken = state.step_index if state.phase == Phase.DENOISE else state.num_steps if state.phase in (Phase.DECODE, Phase.DONE) else 0
    if len(trace.latents) != taken + 1:
        c.fail("rollout.latents", f"must hold {taken + 1} latents after {taken} transitions")
    for i, t in enumerate(trace.latents):
        c.tensor(f"rollout.latents[{i}]", shape=tuple(state.latents.shape), value=t)
    if len(trace.log_probs) != taken:
        c.fail("rollout.log_probs", f"must hold {taken} finite floats, one per transition taken")


def check_text(c: _Checker, state: LoopState, text_len: int, text_dim: int, dtype: torch.dtype) -> None:
    needed = ["prompt_embeds"] + (["negative_prompt_embeds"] if state.cfg else [])
    if state.phase == "encode":
        if not isinstance(state.encode_slots, list) or not set(state.encode_slots) <= set(EMBED_SLOTS):
            c.fail("encode_slots", f"must list some of {EMBED_SLOTS}, got {state.encode_slots!r}")
        ids = c.tensor("input_ids", dims=2, floating=False)
        c.tensor("attention_mask", shape=tuple(ids.shape), floating=False)
        if ids.shape[0] != len(state.encode_slots) or ids.shape[1] != text_len:
            c.fail("input_ids", f"must be [{len(state.encode_slots)}, {text_len}], got {list(ids.shape)}")
        needed = [name for name in needed if name not in state.encode_slots]
    for name in needed:
        embeds = c.tensor(name, shape=(1, text_len, text_dim))
        if embeds.dtype != dtype:  # the dtype the denoiser takes them in (the loop casts them so)
            c.fail(name, f"must be {dtype}, got {embeds.dtype}")
