"""Qwen-Image cards: text-to-image (the released `qwen-image`, the embedded `tiny-qwen-image`) and image
editing (the released `qwen-image-edit`, the embedded `tiny-qwen-image-edit`).

diffusers' own classes throughout (QwenImageTransformer2DModel, AutoencoderKLQwenImage, and
Qwen2.5-VL as the text encoder, read for its last hidden state), so a QwenImagePipeline folder loads
as it is. The recipe is QwenImagePipeline's: 50 steps, classifier-free guidance as `true_cfg_scale`
(4.0 by default, on when a negative prompt is given), text up to 512 tokens, and the scheduler config
Qwen/Qwen-Image ships (scheduler/scheduler_config.json): the image pipelines' shifted Euler schedule
with an exponential time shift between 0.5 and 0.9, stretched to end at sigma 0.02.
"""

from __future__ import annotations

from fvgraph.cards.wan import PARITY as WAN_PARITY
from fvgraph.card import ComponentSpec, ModelCard, QuantizationSpec, RecipeSpec, SamplerSpec, ShapeRules

SCHEDULER = SamplerSpec(
    name="flow_euler_image",
    config={"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
            "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential"},
)  # fmt: skip

# The released transformer; perf/ builds randomly initialised models at this size.
QWEN_IMAGE_TRANSFORMER = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip

PARITY = WAN_PARITY  # the Wan cards' bounds (measured on tiny-wan) until this family's own are measured
# FP8 leaves the embedders, the output norm and projection and the first and last blocks alone.
EMBEDDERS = ("img_in", "txt_in", "txt_norm", "time_text_embed.*", "norm_out.*", "proj_out")


def _components(dit: dict | None, vae: dict | None, text: dict | None, tokenizer: dict | None, dtype: str) -> dict:
    spec = lambda kind, cls, folder, config, dt=dtype: ComponentSpec(kind=kind, cls=cls, subfolder=folder, config=config, dtype=dt)  # noqa: E731
    return {
        "transformer": spec("dit", "diffusers.QwenImageTransformer2DModel", "transformer", dit),
        "vae": spec("vae", "diffusers.AutoencoderKLQwenImage", "vae", vae, "fp32"),  # decoded in fp32, as the other cards do
        "text_encoder": spec("text_encoder", "transformers.Qwen2_5_VLForConditionalGeneration", "text_encoder", text),
        "tokenizer": spec("tokenizer", "transformers.AutoTokenizer", "tokenizer", tokenizer),
    }


def _recipe(steps: int, precision: str = "bf16", name: str = "qwen-image", loop: str = "qwen_image") -> RecipeSpec:
    # guidance_scale is the denoiser's embedded guidance in diffusers' pipeline; Qwen-Image's weights take none.
    # At least 2 steps: one sigma is its own terminal, so shift_terminal's stretch divides 0 by 0 (diffusers'
    # scheduler, and so QwenImagePipeline, gives NaN; tests/test_qwen_image.py).
    return RecipeSpec(method="base", name=name, assumes_loop=loop, sampler=SCHEDULER, default_steps=steps,
                      allowed_steps=(2, 100), precision=precision, default_guidance_scale=1.0, cfg_scale="true_cfg_scale",
                      default_true_cfg_scale=4.0)  # fmt: skip


TEXT_LEN = 512  # QwenImagePipeline's max_sequence_length: the default and the most a request may ask for

QWEN_IMAGE = ModelCard(
    card_id="qwen-image", hub_repos=("Qwen/Qwen-Image",), family="qwen_image", pipeline_class="QwenImagePipeline", loops=("qwen_image",), recipe=_recipe(50),
    parity=PARITY, components=_components(None, None, None, None, "bf16"),
    shapes=ShapeRules(text_len=TEXT_LEN, max_height=2048, max_width=2048, max_frames=1, default_height=1024, default_width=1024,
                      default_frames=1),
    quantization=QuantizationSpec(fp8_exclude=(*EMBEDDERS, "transformer_blocks.0.*",
                                               f"transformer_blocks.{QWEN_IMAGE_TRANSFORMER['num_layers'] - 1}.*")),
)  # fmt: skip

TINY_TRANSFORMER = {**QWEN_IMAGE_TRANSFORMER, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                    "joint_attention_dim": 32, "axes_dims_rope": (4, 6, 6)}  # fmt: skip
# The released VAE's layout (16 latent channels, 8x, its latents_mean / latents_std: the class defaults) at 8 channels.
TINY_VAE = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True]}
# Qwen2.5-VL read as a text model only; the byte tokenizer's ids (pad 0, </s> 1) and a vision tower that never runs.
TINY_TEXT_ENCODER = {
    "text_config": {"vocab_size": 259, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
                    "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
    "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32},
}  # fmt: skip

TINY_QWEN_IMAGE = ModelCard(
    card_id="tiny-qwen-image", family="qwen_image", pipeline_class="QwenImagePipeline", loops=("qwen_image",), parity=PARITY,
    seed=0, components=_components(TINY_TRANSFORMER, TINY_VAE, TINY_TEXT_ENCODER, {"model_max_length": 1024}, "fp32"),
    recipe=_recipe(8, precision="fp32"),
    shapes=ShapeRules(text_len=TEXT_LEN, max_height=256, max_width=256, max_frames=1, default_height=64, default_width=64,
                      default_frames=1),
    quantization=QuantizationSpec(fp8_exclude=EMBEDDERS),
)  # fmt: skip


def _edit_components(dit: dict | None, vae: dict | None, text: dict | None, tokenizer: dict | None, processor: dict | None,
                     dtype: str) -> dict:  # fmt: skip
    """Qwen-Image's components plus the image processor; QwenImageEditPipeline prompts through its
    `processor` (processor/: the image processor and the tokenizer beside it), so both load from there."""
    return {**_components(dit, vae, text, None, dtype),
            "tokenizer": ComponentSpec(kind="tokenizer", cls="transformers.AutoTokenizer", subfolder="processor", config=tokenizer),
            # Qwen2VLProcessor's image processor, by the name Qwen2VLProcessor loads it (transformers falls back to
            # its PIL backend where torchvision is absent).
            "image_processor": ComponentSpec(kind="image_processor", cls="transformers.Qwen2VLImageProcessor",
                                             subfolder="processor", config=processor)}  # fmt: skip


# The vision-language prompt holds the image's tokens (about 1,370 for the ~1024^2 image the released
# processor sees: 14-pixel patches merged 2x2) beside the text, and QwenImageEditPipeline cuts none of it.
EDIT_TEXT_LEN = 2048

# Qwen-Image-Edit: image editing (fvgraph/loops/qwen_image_edit_loop.py) on Qwen-Image's architecture and
# schedule, with QwenImageEditPipeline's defaults (50 steps, true_cfg_scale 4.0).
QWEN_IMAGE_EDIT = ModelCard(
    card_id="qwen-image-edit", hub_repos=("Qwen/Qwen-Image-Edit",), family="qwen_image", pipeline_class="QwenImageEditPipeline",
    loops=("qwen_image_edit",), recipe=_recipe(50, name="qwen-image-edit", loop="qwen_image_edit"), parity=PARITY,
    components=_edit_components(None, None, None, None, None, "bf16"),
    shapes=ShapeRules(text_len=EDIT_TEXT_LEN, max_height=2048, max_width=2048, max_frames=1, default_height=1024,
                      default_width=1024, default_frames=1),
    quantization=QWEN_IMAGE.quantization,
)  # fmt: skip

# The vision tokens the tiny processor's tokenizer adds after its bytes (ids 259, 260, 261), and the
# text encoder told their ids; the tiny image processor sees at most 36 merged tokens of the image.
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
TINY_EDIT_TEXT_ENCODER = {**TINY_TEXT_ENCODER, "text_config": {**TINY_TEXT_ENCODER["text_config"], "vocab_size": 262},
                          "vision_start_token_id": 259, "image_token_id": 260, "vision_end_token_id": 261}  # fmt: skip
TINY_IMAGE_PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 36, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}

# tiny-qwen-image's transformer and VAE (the same seeded weights) as an editor, with a text encoder that reads images.
TINY_QWEN_IMAGE_EDIT = ModelCard(
    card_id="tiny-qwen-image-edit", family="qwen_image", pipeline_class="QwenImageEditPipeline", loops=("qwen_image_edit",),
    parity=PARITY, seed=0, recipe=_recipe(8, precision="fp32", name="qwen-image-edit", loop="qwen_image_edit"),
    components=_edit_components(TINY_TRANSFORMER, TINY_VAE, TINY_EDIT_TEXT_ENCODER,
                                {"model_max_length": 1024, "special_tokens": VISION_TOKENS}, TINY_IMAGE_PROCESSOR, "fp32"),
    # The released card's limits: an edit without a size runs at its image's ~1024^2 edit size.
    shapes=ShapeRules(text_len=1024, max_height=2048, max_width=2048, max_frames=1, default_height=64, default_width=64,
                      default_frames=1),
    quantization=QuantizationSpec(fp8_exclude=EMBEDDERS),
)  # fmt: skip

CARDS = (TINY_QWEN_IMAGE, QWEN_IMAGE, TINY_QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT)
