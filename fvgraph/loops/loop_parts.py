"""The parts a family supplies to the family-neutral denoise loop (fvgraph/loops/denoise_loop.py).

    loop = DenoiseLoop(card, components, FamilyParts(loop_id="t2v", state_type=T2VState, text=WanText(...),
                                                     denoiser=WanDenoiser(...), latents=VideoLatents()), config)

- `text`: how a request's texts become the text-encode step's inputs, its outputs the state's
  embeddings, and those embeddings each denoise step's request constants.
- `denoiser`: the family's denoise kinds (by CFG, by expert), their step modules, what the denoiser
  adds to a request's state and constants (FLUX's embedded guidance), the sections step caching runs
  on (or None), and the projection layout the eager path reuses text projections by (or None).
- `latents`: the schedule a request runs (an image's shifted by its token count) and the request
  fields that shape its latents.
- `conditioning`: media a request brings (Wan I2V's first frame), each with the phases and kinds that
  encode it before the first denoise step.
- `decoder`: the decode kind and its module.

What a deployment enables on the loop (step caching, adapters, rollouts) is given at build, in one
frozen `LoopConfig`; the loop builds its strategy parts from it and never is finished afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fvgraph.adapters.registry import AdapterRegistry
from fvgraph.caching.calibration_store import CalibrationStore
from fvgraph.caching.methods import METHODS
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import StepKind
from fvgraph.loops.samplers import SamplerPlan
from fvgraph.loops.taps import TapPoints
from fvgraph.models.components import Components
from fvgraph.models.projection_cache_protocol import ProjectionCache

if TYPE_CHECKING:
    from fvgraph.loops.denoise_state import DenoiseState
    from fvgraph.request import Request

# Request fields that only some families read; a family lists those it reads (FamilyParts.reads) and a
# request that sets another is refused naming it. The rest of Request is every family's.
FAMILY_FIELDS = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds",
                 "prompt_embeds_mask", "negative_prompt_embeds_mask", "max_sequence_length", "image", "auto_resize", "guidance_scale_2", "video",
                 "strength")  # fmt: skip


class TextConditioning(Protocol):
    kind: StepKind  # the text-encode step
    reads: tuple[str, ...]  # FAMILY_FIELDS it reads
    device_fields: tuple[str, ...]  # state fields it adds that live on the device (moved on resume)

    def build(self, components: Components) -> nn.Module: ...

    def check(self, resolved: Request) -> None: ...  # RequestRejected naming the field

    def init_fields(self, request: Request) -> dict[str, Any]: ...  # its state fields, from the request

    def given(self, embeds: torch.Tensor | None) -> torch.Tensor | None: ...  # [L, D] user embeddings as the state holds them

    def tokenize(self, state: DenoiseState, request: Request, texts: list[tuple[str, str]]) -> None: ...

    def encode_inputs(self, state: DenoiseState) -> dict[str, torch.Tensor]: ...

    def take_encoded(self, state: DenoiseState, result: StepResult) -> None: ...  # outputs into the state's slots

    def finish(self, state: DenoiseState) -> None: ...  # every text known (encoded or given)

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]: ...  # denoise inputs beside the embeddings

    def check_saved(self, checker: Any, state: DenoiseState) -> None: ...

    def warmup_text(self, guidance_scale: float, with_encoder: bool) -> dict[str, Any]: ...  # Request fields


class Denoiser(Protocol):
    kinds: Mapping[bool, StepKind]  # the plain denoise kinds, by CFG (the first expert's)
    step_kinds: dict[str, StepKind]  # every plain denoise kind, every expert's
    reads: tuple[str, ...]
    teacache_signal: str | None  # None: the family has no denoiser sections, so no step caching

    # `tap_points(transformer)`: the parity taps on that denoiser (None: a production step)
    def steps(self, components: Components, sampler: Any, tap_points: Callable[[nn.Module], TapPoints | None]) -> dict[str, nn.Module]: ...

    def step(self, transformer: nn.Module, sampler: Any, cfg: bool, tap_points: TapPoints | None) -> nn.Module: ...

    def sections(self, transformer: nn.Module) -> DenoiserSections | None: ...

    def check(self, resolved: Request) -> None: ...

    def init_fields(self, request: Request) -> dict[str, Any]: ...

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]: ...

    def changes_kind(self, state: DenoiseState) -> bool: ...  # its derived facts no longer hold (an expert boundary)

    def at_step(self, state: DenoiseState, kind: str, constants: dict[str, torch.Tensor]) -> tuple[str, dict]: ...

    def warmup_guidance(self, guidance_scale: float) -> dict[str, Any]: ...


class Latents(Protocol):
    reads: tuple[str, ...]

    def check(self, request: Request) -> None: ...  # before resolve: the fields that shape the latents

    # steps start..num_steps-1 of the num_steps schedule (start > 0: entered part-way, as video-to-video)
    def planned(self, sampler: Any, num_steps: int, latent_hw: tuple[int, int], start: int = 0) -> SamplerPlan: ...

    def warmup_frames(self, num_frames: int) -> dict[str, Any]: ...


class Conditioning(Protocol):
    phases: tuple[Phase, ...]
    step_kinds: dict[str, StepKind]
    reads: tuple[str, ...]
    device_fields: tuple[str, ...]

    def build(self, components: Components) -> dict[str, nn.Module]: ...

    def check(self, resolved: Request) -> None: ...

    def init_fields(self, request: Request, latents: torch.Tensor) -> dict[str, Any]: ...

    def first_phase(self, state: DenoiseState) -> Phase | None: ...  # where a request goes after its texts; None: denoise

    def plan(self, state: DenoiseState) -> WorkPlan: ...  # the step of the state's phase (one of `phases`)

    def take(self, state: DenoiseState, result: StepResult) -> None: ...  # that step's outputs; sets the next phase

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]: ...

    def after_last_step(self, state: DenoiseState) -> None: ...

    def check_saved(self, state: DenoiseState) -> None: ...  # ValueError naming the field

    def warmup_inputs(self, height: int, width: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Decoder:
    """The family's decode step (its VAE's whole decode) and how its output becomes pixels in [0, 1]:
    the step's `vae_latents(latents)` is what a tiled decode runs per tile (fvgraph/loops/tiled_coding.py)
    and `postprocess` what it applies to the stitched tiles."""

    kind: StepKind
    build: Callable[[Components], nn.Module]
    postprocess: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FamilyParts:
    """A family's loop, as parts; `DenoiseLoop` composes them."""

    loop_id: str
    state_type: type
    text: TextConditioning
    denoiser: Denoiser
    latents: Latents
    decoder: Decoder
    conditioning: Conditioning | None = None
    rollouts: bool = False  # Flow-GRPO rollouts (single-expert text-to-video only)
    caching_refused: str | None = None  # why requests with `cache` are refused although the denoiser has sections
    # The eager path's projection reuse for this family's denoiser (None: it has no layout for one).
    projection_layout: Callable[[nn.Module, ProjectionCache], None] | None = None

    @property
    def reads(self) -> frozenset[str]:
        parts = (self.text, self.denoiser, self.latents, *((self.conditioning,) if self.conditioning else ()))
        return frozenset(name for part in parts for name in part.reads)


@dataclass(frozen=True)
class LoopConfig:
    """What the deployment decides for every loop it builds: handed to the loop at construction."""

    calibration: CalibrationStore = field(default_factory=CalibrationStore)  # where calibrated step-caching settings are
    step_caching_methods: tuple[str, ...] = tuple(METHODS)  # the step-caching methods requests may pick
    adapters: AdapterRegistry | None = None  # the engine's LoRA adapters
    run_facts: Mapping[str, Any] = field(default_factory=dict)  # opt level and parallel plan, for rollout records
    # Tiled VAE decode and encode (None: off; True: diffusers' defaults for the VAE class; a dict: the
    # keywords of its enable_tiling), run as one step per tile (fvgraph/loops/tiled_coding.py).
    vae_tiling: bool | Mapping[str, Any] | None = None
