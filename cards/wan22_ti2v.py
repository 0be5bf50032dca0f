"""Wan 2.2 TI2V-5B cards: one denoiser for text-to-video and text-and-image-to-video, on the Wan 2.2
VAE (48 latent channels, 16x spatial compression: 8x in the VAE after a 2x2 pixel patchify), with
per-token timesteps (loop 'ti2v', fvgraph/loops/ti2v_loop.py), and the embedded `tiny-wan2.2-ti2v`.

Recipe values are those of the release config (wan/configs/wan_ti2v_5B.py in Wan-Video/Wan2.2:
`sample_shift` 5.0, `sample_steps` 50, `sample_guide_scale` 5.0, `frame_num` 121; and
`SUPPORTED_SIZES['ti2v-5B']` in wan/configs/__init__.py: '1280*704' and '704*1280', width by height,
so the default here is 1280 wide by 704 high), and diffusers' scripts/convert_wan_to_diffusers.py
writes the model as a WanPipeline with `expand_timesteps=True` and a UniPC scheduler of flow_shift
5.0. The released card holds no configs: widths, channels and VAE scales come from the checkpoint
folder (fvgraph/contract/model_facts.py).
"""

from __future__ import annotations

from fvgraph.card import ModelCard, QuantizationSpec, RecipeSpec, SamplerSpec, ShapeRules
from fvgraph.cards.latent_rgb_factors import WAN22_LATENT_RGB
from fvgraph.cards.wan import PARITY, TINY_WAN, WAN_UNIPC, _components, _fp8_exclusions

WAN_UNIPC_TI2V = SamplerSpec(name="unipc", config={**WAN_UNIPC.config, "flow_shift": 5.0})

WAN_2_2_TI2V_5B = ModelCard(
    card_id="wan2.2-ti2v-5b",
    hub_repos=("Wan-AI/Wan2.2-TI2V-5B-Diffusers",),
    family="wan",
    components=_components(None, None, None, None, "bf16"),
    loops=("ti2v",),
    recipe=RecipeSpec(
        method="base", assumes_loop="ti2v", sampler=WAN_UNIPC_TI2V, default_steps=50, allowed_steps=(1, 100),
        precision="bf16", default_guidance_scale=5.0,
    ),
    parity=PARITY,
    shapes=ShapeRules(text_len=512, default_height=704, default_width=1280, default_frames=121),
    quantization=_fp8_exclusions(30),
    latent_rgb=WAN22_LATENT_RGB,
    fps=24,  # Wan 2.2 TI2V-5B's videos are 24 fps
)  # fmt: skip

# A seeded Wan 2.2 VAE at tiny width: the released layout (residual blocks, 12 = 3 x 2 x 2 patchified
# input channels, 48 latent channels, 16x spatial and 4x temporal compression), one block per level.
# Its normalization constants are arbitrary but not trivial, so a missed (de)normalization shows.
TINY_WAN_2_2_VAE = {
    "base_dim": 8, "decoder_base_dim": 8, "z_dim": 48, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
    "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
    "scale_factor_temporal": 4, "scale_factor_spatial": 16,
    "latents_mean": [round(0.05 * (i % 7 - 3), 2) for i in range(48)],
    "latents_std": [round(0.5 + 0.1 * (i % 9), 1) for i in range(48)],
}  # fmt: skip

_TINY = TINY_WAN.components
TINY_WAN_2_2_TI2V = ModelCard.model_validate(
    {
        **TINY_WAN.model_dump(),
        "card_id": "tiny-wan2.2-ti2v",
        "components": _components(
            dit={**_TINY["transformer"].config, "in_channels": 48, "out_channels": 48},
            vae=TINY_WAN_2_2_VAE, te=_TINY["text_encoder"].config, tok=_TINY["tokenizer"].config, dit_dtype="fp32",
        ),  # fmt: skip
        "loops": ("ti2v",),
        "recipe": {**TINY_WAN.recipe.model_dump(), "assumes_loop": "ti2v", "sampler": WAN_UNIPC_TI2V.model_dump()},
        "quantization": QuantizationSpec(fp8_exclude=("patch_embedding", "condition_embedder.*", "proj_out")),
    }
)

CARDS = (TINY_WAN_2_2_TI2V, WAN_2_2_TI2V_5B)
