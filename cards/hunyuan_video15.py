"""HunyuanVideo-1.5 cards: the released 480p text- and image-to-video models and their embedded tiny twins
(`tiny-hunyuanvideo1.5`, `tiny-hunyuanvideo1.5-i2v`).

diffusers' own classes throughout (HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15,
Qwen2.5-VL's text model read at its third-to-last hidden state, T5's encoder as ByT5 for quoted text;
SigLIP's vision tower and feature extractor for image-to-video), so a HunyuanVideo15Pipeline or
HunyuanVideo15ImageToVideoPipeline folder loads as it is. The recipe is the pipeline's: flow-matching Euler
on sigmas linspace(1, 0, N + 1)[:-1] shifted by the scheduler's `shift`, and guidance as its
ClassifierFreeGuidance at `guidance_scale`. A checkpoint's own scheduler shift, guider scale and
transformer `target_size` (the default size) replace the card's values when the loop is built
(fvgraph/loops/hunyuan_video15_recipe.py); the card's are what a folder that says nothing runs.
"""

from __future__ import annotations

from fvgraph.card import ComponentSpec, ModelCard, QuantizationSpec, RecipeSpec, SamplerSpec, ShapeRules
from fvgraph.cards.wan import PARITY as WAN_PARITY

LOOP = "hunyuan_video15_t2v"
PIPELINE = "HunyuanVideo15Pipeline"
TEXT_LEN = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length: Qwen2.5-VL's tokens after the template's prefix
PARITY = WAN_PARITY  # the Wan cards' bounds (measured on tiny-wan) until this family's own are measured
EMBEDDERS = ("x_embedder.*", "image_embedder.*", "context_embedder.*", "context_embedder_2.*", "time_embed.*",
             "cond_type_embed", "norm_out.*", "proj_out")  # fmt: skip

# Qwen2.5-VL's chat template as it renders a conversation of plain-text messages (what the pipeline hands it).
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


def _components(dit: dict | None, vae: dict | None, text: dict | None, glyph: dict | None, tokenizer: dict | None,
                dtype: str) -> dict:  # fmt: skip
    spec = lambda kind, cls, folder, config, dt=dtype: ComponentSpec(kind=kind, cls=cls, subfolder=folder, config=config, dtype=dt)  # noqa: E731
    return {
        "transformer": spec("dit", "diffusers.HunyuanVideo15Transformer3DModel", "transformer", dit),
        "vae": spec("vae", "diffusers.AutoencoderKLHunyuanVideo15", "vae", vae, "fp32"),  # decoded in fp32, as the other cards do
        "text_encoder": spec("text_encoder", "transformers.Qwen2_5_VLTextModel", "text_encoder", text),
        "tokenizer": spec("tokenizer", "transformers.AutoTokenizer", "tokenizer", tokenizer),
        "text_encoder_2": spec("text_encoder", "transformers.T5EncoderModel", "text_encoder_2", glyph),
        "tokenizer_2": spec("tokenizer", "transformers.AutoTokenizer", "tokenizer_2", None if glyph is None else {"model_max_length": 256}),
    }


def _recipe(shift: float, guidance: float, steps: int, precision: str, loop: str = LOOP) -> RecipeSpec:
    sampler = SamplerSpec(name="flow_euler", config={"num_train_timesteps": 1000, "shift": shift})
    return RecipeSpec(method="base", name="hunyuanvideo1.5", assumes_loop=loop, sampler=sampler, default_steps=steps,
                      allowed_steps=(1, 100), precision=precision, default_guidance_scale=guidance)  # fmt: skip


# The 480p text-to-video release: shift 5 and guidance 6 as its scheduler and guider folders say (the
# loop reads the folder's own), 121 frames at the 480p bucket nearest 16:9.
HUNYUANVIDEO15_480P_T2V = ModelCard(
    card_id="hunyuanvideo1.5-480p-t2v", hub_repos=("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",), family="hunyuan_video15",
    pipeline_class=PIPELINE, loops=(LOOP,), recipe=_recipe(5.0, 6.0, 50, "bf16"), parity=PARITY,
    components=_components(None, None, None, None, None, "bf16"),
    shapes=ShapeRules(text_len=TEXT_LEN, max_height=1280, max_width=1280, max_frames=129, default_height=480, default_width=848,
                      default_frames=121),
    quantization=QuantizationSpec(fp8_exclude=(*EMBEDDERS, "transformer_blocks.0.*", "transformer_blocks.53.*")),
    fps=24,
)  # fmt: skip

# diffusers' own test sizes (tests/pipelines/hunyuan_video1_5) for the transformer; the released VAE's
# ratios (16x spatial, 4x temporal: sizes are multiples of 16 as every card's) at 8 channels and 4 latent
# channels; Qwen2.5-VL of three layers (hidden state -3 is a layer's output) over the byte tokenizer
# with Qwen's chat template; ByT5's vocabulary (384) for its encoder. target_size 48: a 32x48 default.
TINY_TRANSFORMER = {
    "in_channels": 9, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2,
    "num_refiner_layers": 1, "mlp_ratio": 2.0, "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 16,
    "text_embed_2_dim": 32, "image_embed_dim": 12, "rope_axes_dim": (2, 2, 4), "target_size": 48, "task_type": "t2v",
}  # fmt: skip
TINY_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (8, 8, 8, 8, 8), "layers_per_block": 1,
            "spatial_compression_ratio": 16, "temporal_compression_ratio": 4, "downsample_match_channel": False,
            "upsample_match_channel": False}  # fmt: skip
TINY_TEXT_ENCODER = {"vocab_size": 259, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}}  # fmt: skip
TINY_GLYPH_ENCODER = {"vocab_size": 384, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 1, "num_heads": 4,
                      "relative_attention_num_buckets": 8, "dropout_rate": 0.0}  # fmt: skip

TINY_HUNYUANVIDEO15 = ModelCard(
    card_id="tiny-hunyuanvideo1.5", family="hunyuan_video15", pipeline_class=PIPELINE, loops=(LOOP,), parity=PARITY, seed=0,
    components=_components(TINY_TRANSFORMER, TINY_VAE, TINY_TEXT_ENCODER, TINY_GLYPH_ENCODER,
                           {"model_max_length": 2048, "chat_template": CHATML}, "fp32"),
    recipe=_recipe(7.0, 6.0, 8, "fp32"),
    shapes=ShapeRules(text_len=TEXT_LEN, max_height=128, max_width=128, max_frames=33, default_height=32, default_width=48,
                      default_frames=9),
    quantization=QuantizationSpec(fp8_exclude=EMBEDDERS),
    fps=24,
)  # fmt: skip

# HunyuanVideo15Transformer3DModel's default config: the 480p release's sizes (54 dual-stream blocks of
# 16 heads x 128, a 2-layer token refiner, 32 latent channels, target_size 640: a 480x848 default).
RELEASED_TRANSFORMER = {
    "in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 54,
    "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 3584,
    "text_embed_2_dim": 1472, "image_embed_dim": 1152, "rope_axes_dim": (16, 56, 56), "target_size": 640, "task_type": "i2v",
}  # fmt: skip
BENCH_VAE = {**TINY_VAE, "latent_channels": 32}  # the released latent channels, the tiny VAE's blocks
BENCH_QWEN_ROPE = {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}  # heads of 128, as released

# The default CPU workload of perf/bench_step.py for this family: the released blocks' head size at
# wan-cpu-bench's width (4 heads of 128), 2 dual-stream blocks and a 1-layer token refiner, over the
# released conditioning lengths (1000 Qwen + 256 ByT5 + 729 image tokens) beside 180 latent tokens
# (9x96x160, target_size 128's 16:9 bucket): a step is compute, not Python. Seeded weights, a 3-layer
# Qwen2.5-VL text model and a 1-layer ByT5 of the text widths; its outputs mean nothing, only their cost does.
HUNYUANVIDEO_CPU_BENCH = ModelCard.model_validate(
    {
        **TINY_HUNYUANVIDEO15.model_dump(),
        "card_id": "hunyuanvideo-cpu-bench",
        "components": _components(
            {**RELEASED_TRANSFORMER, "num_attention_heads": 4, "num_layers": 2, "num_refiner_layers": 1, "text_embed_dim": 256,
             "text_embed_2_dim": 64, "target_size": 128, "task_type": "t2v"},
            BENCH_VAE,
            {**TINY_TEXT_ENCODER, "hidden_size": 256, "intermediate_size": 256, "rope_scaling": BENCH_QWEN_ROPE},
            {**TINY_GLYPH_ENCODER, "d_model": 64},
            {"model_max_length": 2048, "chat_template": CHATML}, "fp32",
        ),
        "shapes": ShapeRules(text_len=TEXT_LEN, max_height=256, max_width=448, max_frames=33, default_height=96, default_width=160,
                             default_frames=9),
    }
)  # fmt: skip

# The released 480p transformer (8.3B) with seeded weights, beside tiny text encoders of the real widths
# (Qwen2.5-VL 3584, ByT5 1472) and the tiny VAE at 32 latent channels: what perf/gpu_check.sh times on a
# GPU without a checkpoint. Step time depends on shapes, not on weight values.
HUNYUANVIDEO15_480P_BENCH = ModelCard.model_validate(
    {
        **HUNYUANVIDEO_CPU_BENCH.model_dump(),
        "card_id": "hunyuanvideo1.5-480p-bench",
        "components": _components(
            RELEASED_TRANSFORMER, BENCH_VAE,
            {**TINY_TEXT_ENCODER, "hidden_size": 3584, "intermediate_size": 256, "num_attention_heads": 28, "num_key_value_heads": 4,
             "rope_scaling": BENCH_QWEN_ROPE},
            {**TINY_GLYPH_ENCODER, "d_model": 1472, "d_kv": 64, "num_heads": 6, "d_ff": 256},
            {"model_max_length": 2048, "chat_template": CHATML}, "bf16",
        ),
        "recipe": HUNYUANVIDEO15_480P_T2V.recipe,
        "shapes": HUNYUANVIDEO15_480P_T2V.shapes,
        "quantization": HUNYUANVIDEO15_480P_T2V.quantization,
    }
)  # fmt: skip

# -- image-to-video: the same parts, SigLIP's image tokens and the image's latents on frame 0 ----------------

I2V_LOOP = "hunyuan_video15_i2v"
I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"


def _image_components(encoder: dict | None, processor: dict | None) -> dict:
    """SigLIP's vision tower (in fp32, as the VAE: it runs once per request) and its feature extractor,
    in the folders the pipeline saves them in."""
    return {
        "image_encoder": ComponentSpec(kind="image_encoder", cls="transformers.SiglipVisionModel", subfolder="image_encoder",
                                       config=encoder, dtype="fp32"),  # fmt: skip
        "image_processor": ComponentSpec(kind="image_processor", cls="transformers.SiglipImageProcessor", subfolder="feature_extractor",
                                         config=processor),  # fmt: skip
    }


# The 480p image-to-video release: its scheduler, guider and transformer folders give the shift, the
# guidance scale and the target size the image's bucket is taken from (the loop reads the folder's own).
HUNYUANVIDEO15_480P_I2V = ModelCard(
    card_id="hunyuanvideo1.5-480p-i2v", hub_repos=("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",), family="hunyuan_video15",
    pipeline_class=I2V_PIPELINE, loops=(I2V_LOOP,), recipe=_recipe(5.0, 6.0, 50, "bf16", I2V_LOOP), parity=PARITY,
    components={**_components(None, None, None, None, None, "bf16"), **_image_components(None, None)},
    shapes=HUNYUANVIDEO15_480P_T2V.shapes, quantization=HUNYUANVIDEO15_480P_T2V.quantization, fps=24,
)  # fmt: skip

# tiny-hunyuanvideo1.5's sizes with task_type "i2v" and a SigLIP of the transformer's image width (12):
# 32x32 pixels in patches of 8, 16 image tokens.
TINY_SIGLIP = {"hidden_size": 12, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32,
               "patch_size": 8}  # fmt: skip
TINY_SIGLIP_PROCESSOR = {"size": {"height": 32, "width": 32}}

TINY_HUNYUANVIDEO15_I2V = ModelCard(
    card_id="tiny-hunyuanvideo1.5-i2v", family="hunyuan_video15", pipeline_class=I2V_PIPELINE, loops=(I2V_LOOP,), parity=PARITY, seed=0,
    components={**_components({**TINY_TRANSFORMER, "task_type": "i2v"}, TINY_VAE, TINY_TEXT_ENCODER, TINY_GLYPH_ENCODER,
                              {"model_max_length": 2048, "chat_template": CHATML}, "fp32"),
                **_image_components(TINY_SIGLIP, TINY_SIGLIP_PROCESSOR)},
    recipe=_recipe(7.0, 6.0, 8, "fp32", I2V_LOOP), shapes=TINY_HUNYUANVIDEO15.shapes, quantization=TINY_HUNYUANVIDEO15.quantization,
    fps=24,
)  # fmt: skip

CARDS = (TINY_HUNYUANVIDEO15, HUNYUANVIDEO15_480P_T2V, TINY_HUNYUANVIDEO15_I2V, HUNYUANVIDEO15_480P_I2V,
         HUNYUANVIDEO_CPU_BENCH, HUNYUANVIDEO15_480P_BENCH)
