"""LightX2V's Wan 2.2 A14B 4-step distill: one LoRA per expert, its card's latents equal to the recipe's
own loop transcribed here and run on diffusers' WanPipeline over an untouched copy of the weights,
each expert's file loaded by diffusers' LoRA loader; and the recipe contract.

The recipe (ModelTC/LightX2V):
- configs/distill/wan22/wan_moe_t2v_distill_lora.json: infer_steps 4, denoising_step_list
  [1000, 750, 500, 250], sample_shift 5, enable_cfg false, boundary_step_index 2, lora_configs
  high_noise_model and low_noise_model (lightx2v/Wan2.2-Distill-Loras, strength 1.0 each);
- lightx2v/models/schedulers/wan/step_distill/scheduler.py: WanStepDistillScheduler.set_denoising_timesteps
  and Wan22StepDistillScheduler.step_post;
- lightx2v/models/runners/wan/wan_distill_runner.py: MultiDistillModelStruct.get_current_model_index,
  the high-noise model while step_index < boundary_step_index, the low-noise model after.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import WanPipeline

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.card_choices import with_recipe
from fvgraph.cards import get_card
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request, RequestRejected
from lora_files import ATTENTION, peft_lora
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

CARD = "wan2.2-t2v-a14b-lightx2v-4step"
SHAPE = {"height": 48, "width": 64, "num_frames": 5}
# the published config's values, as the transcription below takes them
DENOISING_STEP_LIST, SAMPLE_SHIFT, BOUNDARY_STEP_INDEX = [1000, 750, 500, 250], 5.0, 2


class LightX2VWan22StepDistill:
    """Wan22StepDistillScheduler: the step list's timesteps (set_denoising_timesteps) and its
    deterministic update (step_post), shaped as the scheduler diffusers' WanPipeline calls."""

    order = 1
    config = SimpleNamespace(num_train_timesteps=1000)

    def __init__(self, denoising_step_list, sample_shift):
        self.denoising_step_list, self.sample_shift = list(denoising_step_list), sample_shift
        self.num_train_timesteps, self.sigma_max, self.sigma_min = 1000, 1.0, 0.0
        self.infer_steps = len(self.denoising_step_list)

    def set_begin_index(self, begin_index: int = 0) -> None:
        pass  # the transcription counts its own steps

    def set_timesteps(self, num_inference_steps, device=None):
        assert num_inference_steps == self.infer_steps
        sigma_start = self.sigma_min + (self.sigma_max - self.sigma_min)
        sigmas = torch.linspace(sigma_start, self.sigma_min, self.num_train_timesteps + 1)[:-1]
        sigmas = self.sample_shift * sigmas / (1 + (self.sample_shift - 1) * sigmas)
        timesteps = sigmas * self.num_train_timesteps
        index = [self.num_train_timesteps - x for x in self.denoising_step_list]
        self.timesteps, self.sigmas = timesteps[index].to(device), sigmas[index].to("cpu")
        self.step_index = 0

    def step(self, model_output, timestep, sample, return_dict=False):
        flow_pred = model_output.to(torch.float32)
        sigma = self.sigmas[self.step_index].item()
        x = sample.to(torch.float32) - flow_pred * sigma
        if self.step_index < self.infer_steps - 1:
            sigma_n = self.sigmas[self.step_index + 1].item()
            x = x + flow_pred * sigma_n
        self.step_index += 1
        return (x.to(sample.dtype),)


def _lightx2v_reference(pipe, high_lora, low_lora, seed: int, prompt_embeds, **call):
    """The recipe on diffusers' pipeline: each expert's LoRA through diffusers' loader at strength 1.0,
    the transcribed scheduler, one branch (enable_cfg false), and LightX2V's expert switch. WanPipeline
    runs `transformer` while t >= boundary_ratio x 1000; with the boundary at the timestep of step
    boundary_step_index - 1 of this strictly descending list, that is step_index < boundary_step_index."""
    pipe.load_lora_weights(str(high_lora), adapter_name="high_noise_model")
    pipe.load_lora_weights(str(low_lora), adapter_name="low_noise_model", load_into_transformer_2=True)
    pipe.scheduler = LightX2VWan22StepDistill(DENOISING_STEP_LIST, SAMPLE_SHIFT)
    pipe.scheduler.set_timesteps(len(DENOISING_STEP_LIST))
    pipe.register_to_config(boundary_ratio=float(pipe.scheduler.timesteps[BOUNDARY_STEP_INDEX - 1]) / 1000)
    return pipe(prompt_embeds=prompt_embeds, guidance_scale=1.0, guidance_scale_2=1.0, output_type="latent",
                generator=torch.Generator().manual_seed(seed), num_inference_steps=len(DENOISING_STEP_LIST), **SHAPE, **call).frames  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-wan2.2-a14b's seeded weights written by diffusers' WanPipeline (what the released card loads)."""
    card = get_card("tiny-wan2.2-a14b")
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(WanPipeline, c, tmp_path_factory.mktemp("tiny-a14b"), scheduler=diffusers_scheduler(card.recipe.sampler),
                          boundary_ratio=card.recipe.boundary_ratio)  # fmt: skip


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """One random LoRA per expert in diffusers' layout, under the published names in one folder (the
    role of a local copy of lightx2v/Wan2.2-Distill-Loras)."""
    folder = tmp_path_factory.mktemp("Wan2.2-Distill-Loras")
    recipe = get_card(CARD).recipe.parents
    for seed, adapter in ((1, recipe.adapter), (2, recipe.adapter_2)):
        peft_lora(folder / adapter.name, seed, ATTENTION, rank=4, alpha=4.0, card="tiny-wan2.2-a14b").rename(folder / adapter.weight_name)
    return folder, recipe


@pytest.fixture(scope="module")
def engine(checkpoint, loras):
    folder, recipe = loras
    return Engine.from_card(CARD, checkpoint=checkpoint, device="cpu", dtype="fp32",
                            loras={recipe.adapter.name: folder, recipe.adapter_2.name: folder})  # fmt: skip


def test_card_holds_the_published_recipe():
    recipe = get_card(CARD).recipe
    assert recipe.sampler.timestep_list == tuple(map(float, DENOISING_STEP_LIST)) and recipe.sampler.config["flow_shift"] == SAMPLE_SHIFT
    assert recipe.sampler.name == "few_step_euler" and recipe.allowed_steps == (4, 4) and recipe.step_caching == ()
    assert recipe.default_guidance_scale == recipe.default_guidance_scale_2 == 1.0
    assert (recipe.parents.adapter.weight_name, recipe.parents.adapter_2.weight_name) == (
        "wan2.2_t2v_A14b_high_noise_lora_rank64_lightx2v_4step_1217.safetensors",
        "wan2.2_t2v_A14b_low_noise_lora_rank64_lightx2v_4step_1217.safetensors")  # fmt: skip
    assert recipe.parents.adapter.scale == recipe.parents.adapter_2.scale == 1.0
    i2v = get_card("wan2.2-i2v-a14b-lightx2v-4step").recipe.parents
    assert i2v.adapter.weight_name == "wan2.2_i2v_A14b_high_noise_lora_rank64_lightx2v_4step_1022.safetensors"


def test_card_matches_lightx2v_two_expert_loop_on_wan_pipeline(engine, checkpoint, loras):
    folder, recipe = loras
    pipe = reference_pipeline(WanPipeline, checkpoint)
    assert_shares_no_storage(engine, pipe)
    positive = torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=torch.Generator().manual_seed(5))
    reference = _lightx2v_reference(pipe, folder / recipe.adapter.weight_name, folder / recipe.adapter_2.weight_name, 9, positive)
    kinds = []
    [result] = engine.generate([Request(prompt_embeds=positive, seed=9, output_type="latent", **SHAPE)],
                               on_step=lambda state, kind: kinds.append(kind))  # fmt: skip
    assert result.ok, result.error
    assert kinds == ["denoise", "denoise", "denoise_2", "denoise_2"]  # boundary_step_index 2, one branch each
    assert_matches_reference(result.latents, reference)
    assert result.provenance["merged_loras"] == {recipe.adapter.name: 1.0, recipe.adapter_2.name: 1.0}
    # Each expert's file on the other expert gives another video: the split is the recipe's, not a no-op.
    swapped = _lightx2v_reference(reference_pipeline(WanPipeline, checkpoint), folder / recipe.adapter_2.weight_name,
                                  folder / recipe.adapter.weight_name, 9, positive)  # fmt: skip
    assert (swapped - reference).abs().max() > 0.05


def test_without_its_two_files_the_card_says_which_is_missing(checkpoint, loras):
    folder, recipe = loras
    with pytest.raises(AdapterError, match=r"low_noise_lora_rank64_lightx2v_4step_1217\.safetensors.*'lightx2v_4step_low_noise': PATH"):
        Engine.from_card(CARD, checkpoint=checkpoint, device="cpu", dtype="fp32", loras={recipe.adapter.name: folder})
    with pytest.raises(AdapterError, match="not a file"):  # a folder without the published file
        Engine.from_card(CARD, checkpoint=checkpoint, device="cpu", dtype="fp32",
                         loras={recipe.adapter.name: folder, recipe.adapter_2.name: folder / "lightx2v_4step_low_noise"})  # fmt: skip


@pytest.mark.parametrize(
    "values, field, rule",
    [
        ({"num_inference_steps": 6}, "num_inference_steps", "it takes exactly 4 steps"),
        ({"guidance_scale": 4.0}, "guidance_scale", "guidance is distilled"),
        ({"guidance_scale_2": 3.0}, "guidance_scale_2", "guidance is distilled"),
        ({"negative_prompt": "blurry"}, "negative_prompt", "negative prompt would be ignored"),
        ({"cache": {"method": "teacache", "threshold": 0.08}}, "cache", "admits no step caching"),
    ],
)
def test_requests_outside_the_recipe_are_rejected_naming_it(engine, values, field, rule):
    with pytest.raises(RequestRejected, match=rule) as caught:
        engine.start(Request(prompt_embeds=torch.zeros(4, engine.facts.text_dim), seed=0, **values))
    assert caught.value.field == field and "recipe 'lightx2v-wan2.2-4step'" in str(caught.value)


def test_the_boundary_is_part_of_the_distilled_schedule():
    with pytest.raises(ValueError, match="boundary_ratio: .* whose schedule is the one it was distilled on"):
        with_recipe(get_card(CARD), {"boundary_ratio": 0.9})


def test_i2v_twin_matches_lightx2v_two_expert_loop_on_wan_image_to_video_pipeline(loras, tmp_path):
    """The I2V card on tiny two-expert I2V weights (no image encoder, the first frame through the VAE)."""
    import numpy as np
    import PIL.Image
    from diffusers import WanImageToVideoPipeline

    folder, _ = loras
    distilled, tiny = get_card("wan2.2-i2v-a14b-lightx2v-4step"), get_card("tiny-wan2.2-a14b")
    dit = {**tiny.components["transformer"].config, "in_channels": 36}
    components = {name: spec.model_copy(update={"config": dit if name.startswith("transformer") else tiny.components[name].config,
                                                "dtype": "fp32"})
                  for name, spec in distilled.components.items()}  # fmt: skip
    card = distilled.model_copy(update={"card_id": "tiny-wan2.2-i2v-a14b-lightx2v-4step", "components": components, "seed": 0,
                                        "recipe": distilled.recipe.model_copy(update={"precision": "fp32"}), "shapes": tiny.shapes})  # fmt: skip
    parents = card.recipe.parents
    for adapter, source in ((parents.adapter, get_card(CARD).recipe.parents.adapter), (parents.adapter_2, get_card(CARD).recipe.parents.adapter_2)):
        (folder / adapter.weight_name).write_bytes((folder / source.weight_name).read_bytes())  # the t2v files' attention fits
    engine = Engine.from_card(card, device="cpu", loras={parents.adapter.name: folder, parents.adapter_2.name: folder})
    checkpoint = saved_pipeline(WanImageToVideoPipeline, load_components(card, None, torch.device("cpu")), tmp_path / "checkpoint",
                                scheduler=diffusers_scheduler(get_card("wan2.2-i2v-a14b").recipe.sampler),
                                boundary_ratio=card.recipe.boundary_ratio)  # fmt: skip
    pipe = reference_pipeline(WanImageToVideoPipeline, checkpoint)
    assert_shares_no_storage(engine, pipe)
    image = PIL.Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    positive = torch.randn(1, card.shapes.text_len, engine.facts.text_dim, generator=torch.Generator().manual_seed(6))
    reference = _lightx2v_reference(pipe, folder / parents.adapter.weight_name, folder / parents.adapter_2.weight_name, 4, positive,
                                    image=image)  # fmt: skip
    kinds = []
    [result] = engine.generate([Request(image=image, prompt_embeds=positive, seed=4, output_type="latent", **SHAPE)],
                               on_step=lambda state, kind: kinds.append(kind))  # fmt: skip
    assert result.ok, result.error
    assert [k for k in kinds if k.startswith("denoise")] == ["denoise", "denoise", "denoise_2", "denoise_2"]
    assert_matches_reference(result.latents, reference)
