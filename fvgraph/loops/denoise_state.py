"""What every denoise loop keeps per request, whatever its family: `DenoiseState`.

A family's state type adds only its own conditioning fields (FLUX's pooled texts, Qwen-Image's text
masks, Wan I2V's image latents); strategies keep theirs in one typed field each (`caching`,
`adapters`, `rollout`), each a part that saves itself. Nothing here is video- or image-specific: an
image is a one-frame video of latents [1, C, 1, h, w], and `decoded` holds what the VAE gave back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from fvgraph.adapters.registry import AdapterChoice
from fvgraph.caching.methods import load_state
from fvgraph.caching.state import StepCachingState
from fvgraph.contract.loop import SerializableState
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import ShapeSignature
from fvgraph.events import PreviewEvent
from fvgraph.loops.rollout_trace import RolloutTrace
from fvgraph.loops.causal_decode import ChunkedDecode
from fvgraph.loops.tiled_coding import TileAssembly


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, the copy not waiting for the device: a blocking copy from pageable
    memory waits for every batch queued on the stream, and this runs while one is (an arrival planned,
    a fresh draw in advance, the engine running ahead). On CUDA it goes through pinned memory."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class DenoiseFacts(NamedTuple):
    """Derived once per request from its state (kept in DenoiseState.derived, never saved)."""

    kind: str
    timesteps: tuple[torch.Tensor, ...]  # [1] per step, on the device
    coeffs: tuple[torch.Tensor, ...]  # [1, num_coeffs] per step, on the device
    constants: dict[str, torch.Tensor]  # inputs equal at every step: embeddings, guidance scale
    pixels: tuple[int, int, int]  # (frames, height, width) of the output
    carry_names: tuple[str, ...]  # the step's inputs and outputs for the sampler's history
    signature: ShapeSignature | None  # set from the first step's plan


@dataclass
class DenoiseState(SerializableState):
    """Everything one request needs between steps. Tensors live on CPU or the engine's device."""

    # Whether a request may carry this loop's encoded texts as `prompt_embeds` / `negative_prompt_embeds`
    # (False where a text's conditioning is more than them): rollouts share one encode per group only then.
    embeds_given: ClassVar[bool] = True
    request_id: str
    card_id: str
    seed: int
    cfg: bool
    guidance_scale: float  # the CFG combine's scale (an image card's true_cfg_scale)
    output_type: str
    phase: Phase = field(metadata={"load": Phase})
    step_index: int
    timesteps: torch.Tensor  # [N] as the diffusers scheduler emits them
    coeffs: torch.Tensor  # [N, num_coeffs] sampler rows
    latents: torch.Tensor  # [1, C, F, h, w] float32 (F = 1 for an image)
    carry: list[torch.Tensor]  # sampler history
    # Steps of the sampler's schedule skipped at entry: timesteps are steps start..N-1 of an N-step
    # schedule (video-to-video's strength, fvgraph/loops/source_video.py); 0 for a request from noise.
    schedule_start: int = 0
    # A sampler that re-noises (fvgraph/loops/samplers.py FewStepSampler): the current step's draw, and
    # the request's CPU generator state after it, so a saved request draws on where it stopped.
    fresh_noise: torch.Tensor | None = None  # like latents
    generator_state: torch.Tensor | None = None  # uint8, torch.Generator.get_state()
    input_ids: torch.Tensor | None = None  # [n_texts, L] texts still to encode: positive first
    attention_mask: torch.Tensor | None = None
    encode_slots: list[str] = field(default_factory=list)  # which embeds each encoded row becomes
    prompt_embeds: torch.Tensor | None = None  # [1, L, D]
    negative_prompt_embeds: torch.Tensor | None = None
    decoded: torch.Tensor | None = None  # [1, 3, F, H, W] in [0, 1], once the VAE decoded the latents
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step kind, kept across resume
    weights_version: str = ""  # the weights it was started with: resuming on others would mix two models
    # Step caching (fvgraph/caching/): the method's settings, accumulators and kept tensors, or None.
    caching: StepCachingState | None = field(default=None, metadata={"load": load_state})
    # LoRA adapters (fvgraph/adapters/): the request's names, scales and each adapter's digest, or None.
    adapters: AdapterChoice | None = field(default=None, metadata={"load": AdapterChoice.load})
    # An RL rollout (fvgraph/behavior.py): its noise level and what each transition recorded, or None.
    rollout: RolloutTrace | None = field(default=None, metadata={"load": RolloutTrace.load})
    # Step previews (fvgraph/loops/previews.py): every how many steps, and the one made by the last step
    # until the engine hands it on (not saved: a resumed request previews from its next preview step).
    preview_every: int | None = None
    preview: PreviewEvent | None = field(default=None, metadata={"transient": True})
    # A tiled decode's tiles so far (fvgraph/loops/tiled_coding.py); not saved: a resumed decode starts over.
    tiles: TileAssembly | None = field(default=None, metadata={"transient": True})
    # A chunked decode's progress (fvgraph/loops/causal_decode.py), and the frames the last decode step
    # made final until the engine hands them on; neither saved: a resumed decode starts over.
    chunks: ChunkedDecode | None = field(default=None, metadata={"transient": True})
    new_frames: tuple[int, torch.Tensor] | None = field(default=None, metadata={"transient": True})
    # What next() derives at the first denoise step (on this engine's device); rebuilt after resume.
    derived: DenoiseFacts | None = field(default=None, metadata={"transient": True})

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])
