"""Few-step distilled Wan cards: LightX2V's 4-step step-and-CFG distill of Wan 2.1 (a LoRA on the base
weights, or a checkpoint with it fused), FastVideo's 3-step DMD FastWan, and the embedded `tiny-wan-4step`.

Each is its base card's components with a recipe that fixes what the weights were distilled for
(fvgraph/recipe.py): the timestep list, one branch (no guidance), no step caching. The schedules are
the recipes' own:

- LightX2V (ModelTC/LightX2V, configs/distill/wan21/wan_t2v_distill_lora_4step_cfg.json and the i2v
  one; lightx2v/models/schedulers/wan/step_distill/scheduler.py, WanStepDistillScheduler):
  denoising_step_list [1000, 750, 500, 250], sample_shift 5, enable_cfg false, the LoRA at strength
  1.0; each step predicts x0 and re-noises it to the next sigma with fresh noise.
- FastWan (hao-ai-lab/FastVideo, the FastWan2.1 T2V 480P pipeline config and DmdDenoisingStage):
  dmd_denoising_steps [1000, 757, 522] in scheduler space (sigma = t / 1000), the same re-noising
  update, one branch. FastVideo runs it with Video Sparse Attention; this card runs dense attention
  (docs/recipes.md says what that changes).
- LightX2V's Wan 2.2 A14B 4-step distill (configs/distill/wan22/wan_moe_t2v_distill_lora.json and
  wan_moe_i2v_distill_with_lora.json; lightx2v/models/schedulers/wan/step_distill/scheduler.py,
  Wan22StepDistillScheduler; lightx2v/models/runners/wan/wan_distill_runner.py, MultiDistillModelStruct):
  one LoRA per expert (high_noise_model / low_noise_model, strength 1.0 each), the same
  denoising_step_list [1000, 750, 500, 250] and sample_shift 5, enable_cfg false, and a deterministic
  flow-Euler step (x0 = x - sigma v, then x0 + sigma_next v). The high-noise expert runs the steps
  before boundary_step_index 2: on this schedule (timesteps 1000, 937.5, 833.3, 625) the released
  cards' boundary_ratio (0.875 T2V, 0.900 I2V) falls between the second and third step, the same split,
  so the recipe keeps it (and refuses another: fvgraph/card_choices.py).
"""

from __future__ import annotations

from fvgraph.card import ModelCard, RecipeSpec, SamplerSpec
from fvgraph.recipe import RecipeAdapter, RecipeParents

from fvgraph.cards.wan import TINY_WAN, WAN_2_1_T2V_1_3B, WAN_2_1_T2V_14B
from fvgraph.cards.wan22 import WAN_2_2_I2V_A14B, WAN_2_2_T2V_A14B
from fvgraph.cards.wan_i2v import WAN_2_1_I2V_14B_480P

LIGHTX2V_4STEP = SamplerSpec(name="few_step_renoise", config={"timesteps": (1000, 750, 500, 250), "flow_shift": 5.0})
LIGHTX2V_WAN22_4STEP = SamplerSpec(name="few_step_euler", config={"timesteps": (1000, 750, 500, 250), "flow_shift": 5.0})
FASTWAN_3STEP = SamplerSpec(name="few_step_renoise", config={"timesteps": (1000, 757, 522), "flow_shift": 1.0})

LIGHTX2V_LORAS = "lightx2v/Wan2.1-Distill-Loras"
LIGHTX2V_WAN22_LORAS = "lightx2v/Wan2.2-Distill-Loras"


def _distilled(base: ModelCard, card_id: str, name: str, sampler: SamplerSpec, adapter: RecipeAdapter | None = None,
               assumes_precision: str | None = "bf16", hub_repos: tuple[str, ...] = (),
               adapter_2: RecipeAdapter | None = None) -> ModelCard:  # fmt: skip
    """`base` with a step-and-CFG-distilled recipe on `sampler`'s listed timesteps (a two-expert base
    keeps its boundary, both experts at guidance 1)."""
    steps = len(sampler.timestep_list)
    two_experts = base.recipe.boundary_ratio is not None
    recipe = RecipeSpec(
        method="step_cfg_distilled", name=name, parents=RecipeParents(base_card=base.card_id, adapter=adapter, adapter_2=adapter_2),
        assumes_loop=base.recipe.assumes_loop, sampler=sampler, default_steps=steps, allowed_steps=(steps, steps),
        precision=base.recipe.precision, assumes_precision=assumes_precision, default_guidance_scale=1.0, step_caching=(),
        boundary_ratio=base.recipe.boundary_ratio, default_guidance_scale_2=1.0 if two_experts else None,
    )  # fmt: skip
    # hub_repos: the base's repo ids are the base card's; a distill names only a repo of its own weights.
    return base.model_copy(update={"card_id": card_id, "recipe": recipe, "default_cache": None, "hub_repos": hub_repos})


def _lightx2v_lora(weight_name: str, in_checkpoint: bool = False) -> RecipeAdapter:
    return RecipeAdapter(name="lightx2v_4step", source=LIGHTX2V_LORAS, weight_name=weight_name, in_checkpoint=in_checkpoint)


_T2V_LORA = "wan2.1_t2v_14b_lora_rank64_lightx2v_4step.safetensors"
_I2V_LORA = "wan2.1_i2v_lora_rank64_lightx2v_4step.safetensors"

WAN_2_1_T2V_14B_LIGHTX2V = _distilled(WAN_2_1_T2V_14B, "wan2.1-t2v-14b-lightx2v-4step", "lightx2v-4step", LIGHTX2V_4STEP,
                                      _lightx2v_lora(_T2V_LORA))  # fmt: skip
# The same recipe from a checkpoint whose transformer already has the distill fused in.
WAN_2_1_T2V_14B_LIGHTX2V_MERGED = _distilled(WAN_2_1_T2V_14B, "wan2.1-t2v-14b-lightx2v-4step-merged", "lightx2v-4step",
                                             LIGHTX2V_4STEP, _lightx2v_lora(_T2V_LORA, in_checkpoint=True))  # fmt: skip
WAN_2_1_I2V_14B_480P_LIGHTX2V = _distilled(WAN_2_1_I2V_14B_480P, "wan2.1-i2v-14b-480p-lightx2v-4step", "lightx2v-4step",
                                           LIGHTX2V_4STEP, _lightx2v_lora(_I2V_LORA))  # fmt: skip
FASTWAN_2_1_T2V_1_3B = _distilled(WAN_2_1_T2V_1_3B, "fastwan2.1-t2v-1.3b", "fastwan-dmd-3step", FASTWAN_3STEP,
                                  hub_repos=("FastVideo/FastWan2.1-T2V-1.3B-Diffusers",))  # fmt: skip

# tiny-wan's architecture and seeded weights under the 4-step recipe: the distilled path on a CPU in
# seconds (its weights were never distilled, so its videos mean nothing; the contract and the sampler do).
TINY_WAN_4STEP = _distilled(TINY_WAN, "tiny-wan-4step", "lightx2v-4step", LIGHTX2V_4STEP, assumes_precision=None)


def _wan22_lora(task: str, noise: str, date: str) -> RecipeAdapter:
    """One expert's file of LightX2V's Wan 2.2 A14B distill (its lora_configs' high_noise_model / low_noise_model)."""
    return RecipeAdapter(name=f"lightx2v_4step_{noise}_noise", source=LIGHTX2V_WAN22_LORAS,
                         weight_name=f"wan2.2_{task}_A14b_{noise}_noise_lora_rank64_lightx2v_4step_{date}.safetensors")  # fmt: skip


WAN_2_2_T2V_A14B_LIGHTX2V = _distilled(WAN_2_2_T2V_A14B, "wan2.2-t2v-a14b-lightx2v-4step", "lightx2v-wan2.2-4step",
                                       LIGHTX2V_WAN22_4STEP, _wan22_lora("t2v", "high", "1217"),
                                       adapter_2=_wan22_lora("t2v", "low", "1217"))  # fmt: skip
WAN_2_2_I2V_A14B_LIGHTX2V = _distilled(WAN_2_2_I2V_A14B, "wan2.2-i2v-a14b-lightx2v-4step", "lightx2v-wan2.2-4step",
                                       LIGHTX2V_WAN22_4STEP, _wan22_lora("i2v", "high", "1022"),
                                       adapter_2=_wan22_lora("i2v", "low", "1022"))  # fmt: skip

CARDS = (WAN_2_1_T2V_14B_LIGHTX2V, WAN_2_1_T2V_14B_LIGHTX2V_MERGED, WAN_2_1_I2V_14B_480P_LIGHTX2V, FASTWAN_2_1_T2V_1_3B,
         TINY_WAN_4STEP, WAN_2_2_T2V_A14B_LIGHTX2V, WAN_2_2_I2V_A14B_LIGHTX2V)  # fmt: skip
