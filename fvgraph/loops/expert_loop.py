"""Two-expert loops of Wan 2.2 A14B: `transformer` denoises the high-noise steps, `transformer_2` the rest.

The t2v and i2v loops' parts with a two-expert WanDenoiser (fvgraph/loops/wan_parts.py says how a
request switches expert); their states add the low-noise expert's guidance.
"""

from __future__ import annotations

from dataclasses import dataclass

from fvgraph.card import ModelCard
from fvgraph.loops.denoise_loop import DenoiseLoop
from fvgraph.loops.i2v_loop import CACHING_REFUSED, I2VState, i2v_parts
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.loops.t2v_loop import WAN_DECODER, T2VState
from fvgraph.loops.wan_parts import SECOND_EXPERT_KINDS, VideoLatents, WanDenoiser, WanText
from fvgraph.models.components import Components
from fvgraph.models.wan_projections import apply_projection_cache

__all__ = ["SECOND_EXPERT_KINDS", "TwoExpertImageToVideoLoop", "TwoExpertTextToVideoLoop"]


@dataclass
class TwoExpertT2VState(T2VState):
    guidance_scale_2: float = 0.0  # the low-noise expert's guidance (resolved at init)


@dataclass
class TwoExpertI2VState(I2VState):
    guidance_scale_2: float = 0.0


class TwoExpertTextToVideoLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        parts = FamilyParts("t2v_two_expert", TwoExpertT2VState, WanText(card, components),
                            WanDenoiser(card, components, two_experts=True), VideoLatents(), WAN_DECODER,
                            caching_refused=f"card {card.card_id!r} runs loop 't2v_two_expert'; {CACHING_REFUSED}",
                            projection_layout=apply_projection_cache)  # fmt: skip
        super().__init__(card, components, parts, config)


class TwoExpertImageToVideoLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        super().__init__(card, components, i2v_parts("i2v_two_expert", TwoExpertI2VState, card, components, two_experts=True),
                         config)  # fmt: skip
