"""FLUX.1 text-to-image cards: the released dev and schnell models and the embedded `tiny-flux`.

diffusers' own classes throughout (FluxTransformer2DModel, AutoencoderKL, CLIPTextModel, T5EncoderModel),
so a FluxPipeline folder loads as it is. The two releases differ in what their recipes assume: dev is
guidance-distilled (the guidance scale is an input of the denoiser: one branch per step, 28 steps, T5
length 512), schnell timestep-distilled (4 steps, no guidance input, T5 length 256, an unshifted
schedule). The scheduler configs are those the releases ship (scheduler/scheduler_config.json).
"""

from __future__ import annotations

from fvgraph.cards.latent_rgb_factors import FLUX_LATENT_RGB
from fvgraph.cards.wan import PARITY as WAN_PARITY
from fvgraph.card import ComponentSpec, ModelCard, QuantizationSpec, RecipeSpec, SamplerSpec, ShapeRules, TeaCacheCoefficients

DEV_SCHEDULER = SamplerSpec(
    name="flow_euler_image",
    config={"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
            "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
)  # fmt: skip
SCHNELL_SCHEDULER = SamplerSpec(name="flow_euler_image", config={**DEV_SCHEDULER.config, "shift": 1.0, "use_dynamic_shifting": False})

# The released transformer; perf/ builds randomly initialised models at this size.
FLUX_DEV_TRANSFORMER = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}  # fmt: skip

# TeaCache's polynomial for FLUX.1-dev (ali-vilab/TeaCache, TeaCache4FLUX/teacache_flux.py): fitted on
# the relative L1 change of the first block's modulated input of the image tokens.
TEACACHE_DEV = TeaCacheCoefficients(modulated_input=(4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01))

PARITY = WAN_PARITY  # the Wan cards' bounds (measured on tiny-wan) until this family's own are measured


def _fp8_exclusions(num_layers: int, num_single_layers: int) -> QuantizationSpec:
    """FP8 leaves the embedders, the output norm and projection and the first and last blocks alone."""
    edges = ("transformer_blocks.0.*", f"single_transformer_blocks.{num_single_layers - 1}.*")
    return QuantizationSpec(fp8_exclude=("x_embedder", "context_embedder", "time_text_embed.*", "norm_out.*", "proj_out", *edges))


def _components(dit: dict | None, vae: dict | None, clip: dict | None, t5: dict | None, clip_tok: dict | None,
                t5_tok: dict | None, dtype: str) -> dict:  # fmt: skip
    spec = lambda kind, cls, folder, config, dt=dtype: ComponentSpec(kind=kind, cls=cls, subfolder=folder, config=config, dtype=dt)  # noqa: E731
    return {
        "transformer": spec("dit", "diffusers.FluxTransformer2DModel", "transformer", dit),
        "vae": spec("vae", "diffusers.AutoencoderKL", "vae", vae, "fp32"),  # decoded in fp32, as the Wan cards do
        "text_encoder": spec("text_encoder", "transformers.CLIPTextModel", "text_encoder", clip),
        "tokenizer": spec("tokenizer", "transformers.AutoTokenizer", "tokenizer", clip_tok),
        "text_encoder_2": spec("text_encoder", "transformers.T5EncoderModel", "text_encoder_2", t5),
        "tokenizer_2": spec("tokenizer", "transformers.AutoTokenizer", "tokenizer_2", t5_tok),
    }


def _recipe(name: str, sampler: SamplerSpec, steps: int, guidance: float, precision: str = "bf16",
            teacache: TeaCacheCoefficients | None = None, loop: str = "flux") -> RecipeSpec:  # fmt: skip
    return RecipeSpec(method="base", name=name, assumes_loop=loop, sampler=sampler, default_steps=steps, allowed_steps=(1, 100),
                      precision=precision, default_guidance_scale=guidance, cfg_scale="true_cfg_scale",
                      teacache_coefficients=teacache)  # fmt: skip


IMAGE_SHAPES = dict(max_height=2048, max_width=2048, max_frames=1, default_height=1024, default_width=1024, default_frames=1)


def _released(card_id: str, recipe: RecipeSpec, text_len: int, hub_repo: str, pipeline_class: str = "FluxPipeline") -> ModelCard:
    return ModelCard(card_id=card_id, hub_repos=(hub_repo,), family="flux", pipeline_class=pipeline_class, loops=(recipe.assumes_loop,),
                     recipe=recipe, parity=PARITY,
                     components=_components(None, None, None, None, None, None, "bf16"),
                     shapes=ShapeRules(text_len=text_len, **IMAGE_SHAPES),
                     quantization=_fp8_exclusions(FLUX_DEV_TRANSFORMER["num_layers"], FLUX_DEV_TRANSFORMER["num_single_layers"]),
                     latent_rgb=FLUX_LATENT_RGB)  # fmt: skip


FLUX_1_DEV = _released("flux.1-dev", _recipe("flux.1-dev", DEV_SCHEDULER, 28, 3.5, teacache=TEACACHE_DEV), text_len=512,
                       hub_repo="black-forest-labs/FLUX.1-dev")
FLUX_1_SCHNELL = _released("flux.1-schnell", _recipe("flux.1-schnell", SCHNELL_SCHEDULER, 4, 0.0), text_len=256,
                           hub_repo="black-forest-labs/FLUX.1-schnell")
# FLUX.1 Kontext [dev]: image editing (fvgraph/loops/flux_kontext_loop.py) on FLUX.1-dev's architecture,
# 28 steps at embedded guidance 2.5, as the release's model card runs it.
FLUX_1_KONTEXT_DEV = _released("flux.1-kontext-dev", _recipe("flux.1-kontext-dev", DEV_SCHEDULER, 28, 2.5, loop="flux_kontext"),
                               text_len=512, hub_repo="black-forest-labs/FLUX.1-Kontext-dev", pipeline_class="FluxKontextPipeline")

TINY_TEXT_LEN = 32
TINY_TRANSFORMER = {**FLUX_DEV_TRANSFORMER, "in_channels": 64, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
                    "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)}  # fmt: skip
# The FLUX VAE's layout (16 latent channels, no quant convs, its scaling and shift) at 8 channels a level.
TINY_VAE = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 8, 8], "layers_per_block": 1, "latent_channels": 16, "norm_num_groups": 4,
    "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
}  # fmt: skip
# CLIP's pooled output sits at the first end-of-text token: the byte tokenizer's "</s>" (id 1).
TINY_CLIP = {"vocab_size": 259, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
             "max_position_embeddings": 77, "projection_dim": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}  # fmt: skip
TINY_T5 = {"vocab_size": 259, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
           "relative_attention_num_buckets": 8, "dropout_rate": 0.0}  # fmt: skip

TINY_FLUX = ModelCard(
    card_id="tiny-flux", family="flux", pipeline_class="FluxPipeline", loops=("flux",), parity=PARITY, seed=0,
    components=_components(TINY_TRANSFORMER, TINY_VAE, TINY_CLIP, TINY_T5, {"model_max_length": 77},
                           {"model_max_length": TINY_TEXT_LEN}, "fp32"),
    recipe=_recipe("flux.1-dev", DEV_SCHEDULER, 8, 3.5, precision="fp32", teacache=TEACACHE_DEV),  # dev's: tiny-flux is its architecture
    shapes=ShapeRules(text_len=TINY_TEXT_LEN, max_height=256, max_width=256, max_frames=1, default_height=64, default_width=64,
                      default_frames=1),
    quantization=QuantizationSpec(fp8_exclude=("x_embedder", "context_embedder", "time_text_embed.*", "norm_out.*", "proj_out")),
)  # fmt: skip

# tiny-flux's seeded weights run as an editor: Kontext is FLUX.1-dev's architecture.
TINY_FLUX_KONTEXT = ModelCard.model_validate(
    {**TINY_FLUX.model_dump(), "card_id": "tiny-flux-kontext", "pipeline_class": "FluxKontextPipeline", "loops": ("flux_kontext",),
     "recipe": _recipe("flux.1-kontext-dev", DEV_SCHEDULER, 8, 2.5, precision="fp32", loop="flux_kontext")}
)  # fmt: skip

# The default CPU workload of perf/bench_step.py for this family: FLUX's blocks at wan-cpu-bench's width
# (4 heads of 128), 2 double- and 2 single-stream blocks, a 192x192 image (144 image + 64 text tokens):
# about 8 GFLOP per step, compute rather than Python on a 2-core CPU in fp32. Seeded weights; its
# outputs mean nothing, only their cost does.
FLUX_CPU_BENCH = ModelCard.model_validate(
    {
        **TINY_FLUX.model_dump(),
        "card_id": "flux-cpu-bench",
        "components": _components(
            {**FLUX_DEV_TRANSFORMER, "num_layers": 2, "num_single_layers": 2, "num_attention_heads": 4,
             "joint_attention_dim": 256, "pooled_projection_dim": 64},
            TINY_VAE, {**TINY_CLIP, "hidden_size": 64, "projection_dim": 64}, {**TINY_T5, "d_model": 256, "num_layers": 1},
            {"model_max_length": 77}, {"model_max_length": 64}, "fp32",
        ),
        "shapes": ShapeRules(text_len=64, max_height=512, max_width=512, max_frames=1, default_height=192, default_width=192,
                             default_frames=1),
    }
)  # fmt: skip

# The released FLUX.1-dev transformer with seeded random weights, beside tiny text encoders of the
# real widths (CLIP pooled 768, one T5 layer of 4096) and the tiny VAE: what perf/gpu_check.sh times
# when no checkpoint is at hand. Step time depends on shapes, not on weight values.
FLUX_1_DEV_BENCH = ModelCard.model_validate(
    {
        **FLUX_CPU_BENCH.model_dump(),
        "card_id": "flux.1-dev-bench",
        "components": _components(
            FLUX_DEV_TRANSFORMER, TINY_VAE, {**TINY_CLIP, "hidden_size": 768, "projection_dim": 768},
            {**TINY_T5, "d_model": 4096, "d_kv": 64, "num_heads": 64, "d_ff": 1024, "num_layers": 1},
            {"model_max_length": 77}, {"model_max_length": 512}, "bf16",
        ),
        "recipe": FLUX_1_DEV.recipe,
        "shapes": FLUX_1_DEV.shapes,
        "quantization": FLUX_1_DEV.quantization,
    }
)  # fmt: skip

# FLUX.1 Kontext's step at flux-cpu-bench's size (its seeded weights, run as an editor): what
# `perf/bench_step.py --card flux-kontext-cpu-bench` times on the CPU. The edited image joins the
# sequence: at the default 192x192 with a condition image of the output's size, 144 + 144 image tokens.
FLUX_KONTEXT_CPU_BENCH = ModelCard.model_validate(
    {**FLUX_CPU_BENCH.model_dump(), "card_id": "flux-kontext-cpu-bench", "pipeline_class": "FluxKontextPipeline",
     "loops": ("flux_kontext",), "recipe": TINY_FLUX_KONTEXT.recipe}
)  # fmt: skip

# The released FLUX.1 Kontext [dev] transformer (FLUX.1-dev's config) with seeded random weights: what
# perf/gpu_check.sh's flux_kontext_step part times when no checkpoint is at hand.
FLUX_1_KONTEXT_DEV_BENCH = ModelCard.model_validate(
    {**FLUX_1_DEV_BENCH.model_dump(), "card_id": "flux.1-kontext-dev-bench", "pipeline_class": "FluxKontextPipeline",
     "loops": ("flux_kontext",), "recipe": FLUX_1_KONTEXT_DEV.recipe}
)  # fmt: skip

CARDS = (TINY_FLUX, FLUX_1_DEV, FLUX_1_SCHNELL, FLUX_CPU_BENCH, FLUX_1_DEV_BENCH, FLUX_1_KONTEXT_DEV, TINY_FLUX_KONTEXT,
         FLUX_KONTEXT_CPU_BENCH, FLUX_1_KONTEXT_DEV_BENCH)
