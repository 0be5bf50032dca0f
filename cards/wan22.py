"""Wan 2.2 A14B cards: two experts (`transformer` for high noise, `transformer_2` for low noise),
switched at `recipe.boundary_ratio` of the training timesteps, and the embedded `tiny-wan2.2-a14b`.

Recipe values are those of the Wan 2.2 release configs (wan/configs/wan_t2v_A14B.py and
wan_i2v_A14B.py in Wan-Video/Wan2.2: `boundary`, `sample_guide_scale` as (low, high), `sample_shift`,
`sample_steps`): T2V A14B boundary 0.875, guidance 4.0 high /
3.0 low, shift 12.0, 40 steps; I2V A14B boundary 0.900, guidance 3.5 / 3.5, shift 5.0, 40 steps. The
I2V model has no CLIP image encoder (the first frame enters through the VAE latents only).
"""

from __future__ import annotations

from fvgraph.card import ComponentSpec, ModelCard, RecipeSpec, SamplerSpec, ShapeRules
from fvgraph.cards.latent_rgb_factors import WAN21_LATENT_RGB
from fvgraph.cards.wan import PARITY, TINY_WAN, WAN_UNIPC, _components, _fp8_exclusions


def _second_expert(config: dict | None, dtype: str) -> dict:
    return {"transformer_2": ComponentSpec(kind="dit", cls="diffusers.WanTransformer3DModel", subfolder="transformer_2",
                                           config=config, dtype=dtype)}  # fmt: skip


def _released(card_id: str, loop: str, shift: float, boundary: float, guidance: tuple[float, float], pipeline: str,
              hub_repo: str) -> ModelCard:  # fmt: skip
    sampler = SamplerSpec(name="unipc", config={**WAN_UNIPC.config, "flow_shift": shift})
    return ModelCard(
        card_id=card_id,
        hub_repos=(hub_repo,),
        family="wan",
        components={**_components(None, None, None, None, "bf16"), **_second_expert(None, "bf16")},
        loops=(loop,),
        recipe=RecipeSpec(
            method="base", assumes_loop=loop, sampler=sampler, default_steps=40, allowed_steps=(1, 100), precision="bf16",
            default_guidance_scale=guidance[0], default_guidance_scale_2=guidance[1], boundary_ratio=boundary,
        ),
        parity=PARITY,
        shapes=ShapeRules(text_len=512, default_height=720, default_width=1280),
        quantization=_fp8_exclusions(40),
        pipeline_class=pipeline,
        latent_rgb=WAN21_LATENT_RGB,  # the A14B experts share Wan 2.1's VAE
    )  # fmt: skip


WAN_2_2_T2V_A14B = _released("wan2.2-t2v-a14b", "t2v_two_expert", 12.0, 0.875, (4.0, 3.0), "WanPipeline",
                            "Wan-AI/Wan2.2-T2V-A14B-Diffusers")
WAN_2_2_I2V_A14B = _released("wan2.2-i2v-a14b", "i2v_two_expert", 5.0, 0.900, (3.5, 3.5), "WanImageToVideoPipeline",
                            "Wan-AI/Wan2.2-I2V-A14B-Diffusers")

_TINY = TINY_WAN.components
TINY_WAN_2_2_A14B = ModelCard.model_validate(
    {
        **TINY_WAN.model_dump(),
        "card_id": "tiny-wan2.2-a14b",
        "components": {**_TINY, **_second_expert(_TINY["transformer"].config, "fp32")},
        "loops": ("t2v_two_expert",),
        # tiny-wan's 480p UniPC schedule, so a few steps straddle the boundary
        "recipe": {**TINY_WAN.recipe.model_dump(), "assumes_loop": "t2v_two_expert", "boundary_ratio": 0.875,
                   "default_guidance_scale": 4.0, "default_guidance_scale_2": 3.0},  # fmt: skip
    }
)

CARDS = (TINY_WAN_2_2_A14B, WAN_2_2_T2V_A14B, WAN_2_2_I2V_A14B)
