"""Wan 2.1 image-to-video cards: the released 14B 480p and 720p models and the embedded `tiny-wan-i2v`.

Components are diffusers' and transformers' own classes, as a WanImageToVideoPipeline checkpoint holds
them: WanTransformer3DModel (36 input channels: 16 latent + 4 mask + 16 first-frame latent; CLIP
image tokens through `image_dim` / `added_kv_proj_dim`), AutoencoderKLWan, UMT5EncoderModel,
CLIPVisionModel and CLIPImageProcessor. The released cards hold no configs: widths and channels come
from the checkpoint folder (fvgraph/contract/model_facts.py).
"""

from __future__ import annotations

from fvgraph.card import ComponentSpec, ModelCard, QuantizationSpec, RecipeSpec, SamplerSpec, ShapeRules
from fvgraph.cards.latent_rgb_factors import WAN21_LATENT_RGB
from fvgraph.cards.wan import PARITY, TINY_TEXT_LEN, TINY_WAN, WAN_UNIPC, _components, _fp8_exclusions

# The 720p model's scheduler config uses flow_shift 5.0 (diffusers' Wan2.1-I2V-14B-720P-Diffusers).
WAN_UNIPC_720P = SamplerSpec(name="unipc", config={**WAN_UNIPC.config, "flow_shift": 5.0})


def _image_components(encoder: dict | None, processor: dict | None) -> dict:
    return {
        "image_encoder": ComponentSpec(kind="image_encoder", cls="transformers.CLIPVisionModel",
                                       subfolder="image_encoder", config=encoder, dtype="fp32"),  # fmt: skip
        "image_processor": ComponentSpec(kind="image_processor", cls="transformers.CLIPImageProcessor",
                                         subfolder="image_processor", config=processor),  # fmt: skip
    }


def _released(card_id: str, sampler: SamplerSpec, height: int, width: int, hub_repo: str) -> ModelCard:
    return ModelCard(
        card_id=card_id,
        hub_repos=(hub_repo,),
        family="wan",
        components={**_components(None, None, None, None, "bf16"), **_image_components(None, None)},
        loops=("i2v",),
        recipe=RecipeSpec(
            method="base", assumes_loop="i2v", sampler=sampler, default_steps=50, allowed_steps=(1, 100),
            precision="bf16", default_guidance_scale=5.0,
        ),
        parity=PARITY,
        shapes=ShapeRules(text_len=512, max_height=1280, max_width=1280, default_height=height, default_width=width),
        quantization=_fp8_exclusions(40),
        pipeline_class="WanImageToVideoPipeline",
        latent_rgb=WAN21_LATENT_RGB,
    )  # fmt: skip


WAN_2_1_I2V_14B_480P = _released("wan2.1-i2v-14b-480p", WAN_UNIPC, 480, 832, "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers")
WAN_2_1_I2V_14B_720P = _released("wan2.1-i2v-14b-720p", WAN_UNIPC_720P, 720, 1280, "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers")

_TINY = TINY_WAN.components
TINY_WAN_I2V = ModelCard.model_validate(
    {
        **TINY_WAN.model_dump(),
        "card_id": "tiny-wan-i2v",
        "components": {
            **_components(
                # 16 latent + 4 mask + 16 first-frame latent channels in; CLIP tokens of width 32
                dit={**_TINY["transformer"].config, "in_channels": 36, "image_dim": 32, "added_kv_proj_dim": 32},
                vae=_TINY["vae"].config, te=_TINY["text_encoder"].config, tok=_TINY["tokenizer"].config, dit_dtype="fp32",
            ),
            **_image_components(
                {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "image_size": 32, "patch_size": 8, "projection_dim": 32},
                {"crop_size": {"height": 32, "width": 32}, "size": {"shortest_edge": 32}},
            ),
        },  # fmt: skip
        "loops": ("i2v",),
        "recipe": {**TINY_WAN.recipe.model_dump(), "assumes_loop": "i2v"},
        "quantization": QuantizationSpec(fp8_exclude=("patch_embedding", "condition_embedder.*", "proj_out")),
        "pipeline_class": "WanImageToVideoPipeline",
        "shapes": {**TINY_WAN.shapes.model_dump(), "text_len": TINY_TEXT_LEN},
    }
)

CARDS = (TINY_WAN_I2V, WAN_2_1_I2V_14B_480P, WAN_2_1_I2V_14B_720P)
