"""The text-to-video loop of Wan-class models: text_encode -> denoise x N -> vae_decode.

The family-neutral DenoiseLoop (denoise_loop.py) with Wan's parts (wan_parts.py): UMT5 text, the Wan
denoiser, video latents, the Wan VAE's decode, and an optional source video (video-to-video,
source_video.py). Requests may use step caching, adapters and rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fvgraph.caching.methods import caching_step_kinds
from fvgraph.card import ModelCard
from fvgraph.loops.denoise_loop import TEXT_ENCODE, VAE_DECODE, DenoiseLoop
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.loops.loop_rollouts import rollout_step_kinds
from fvgraph.loops.source_video import SourceVideo
from fvgraph.loops.tiled_coding import VAE_ENCODE, VAE_ENCODE_KIND
from fvgraph.loops.vae_decoder import NORMALIZED_VAE_DECODER, VAE_DECODE_KIND
from fvgraph.loops.wan_parts import DENOISE, DENOISE_CFG, DENOISE_KINDS, TEXT_ENCODE_KIND, VideoLatents, WanDenoiser, WanText
from fvgraph.models.components import Components
from fvgraph.models.wan_projections import apply_projection_cache
from fvgraph.models.wan_sections import WanSections

WAN_DECODER = NORMALIZED_VAE_DECODER
STEP_KINDS = {
    TEXT_ENCODE: TEXT_ENCODE_KIND,
    DENOISE: DENOISE_KINDS[False],
    DENOISE_CFG: DENOISE_KINDS[True],
    VAE_DECODE: VAE_DECODE_KIND,
    VAE_ENCODE: VAE_ENCODE_KIND,  # a video-to-video request's video
    **caching_step_kinds(DENOISE_KINDS, WanSections.teacache_signal),  # a request with step caching (fvgraph/caching/)
    **rollout_step_kinds(DENOISE_KINDS),  # a rollout request (fvgraph/behavior.py)
}  # fmt: skip


@dataclass
class T2VState(DenoiseState):
    """A Wan text-to-video request's state: `source_video` [1, 3, F, H, W] in [-1, 1] holds a
    video-to-video request's video until it is encoded (fvgraph/loops/source_video.py)."""

    source_video: torch.Tensor | None = None


class TextToVideoLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        parts = FamilyParts("t2v", T2VState, WanText(card, components), WanDenoiser(card, components), VideoLatents(),
                            WAN_DECODER, SourceVideo(card, components), rollouts=len(components.facts.experts) < 2,
                            projection_layout=apply_projection_cache)  # fmt: skip
        super().__init__(card, components, parts, config)
