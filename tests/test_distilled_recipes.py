"""Few-step distilled recipes: each card's latents equal its recipe's own sampler, transcribed here from
the published inference code and run on diffusers' pipelines over an untouched copy of the weights
(LightX2V's 4-step distill with diffusers' LoRA loader, FastVideo's DMD FastWan); the recipe contract
refuses what the weights were not distilled for; the stochastic sampler is reproducible alone, in a
batch and across save / resume."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline
from pydantic import ValidationError

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.card_choices import with_recipe
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.recipe import RecipeSpec
from fvgraph.request import Request, RequestRejected
from fvgraph.runtime.buckets import BucketSpec
from lora_files import ATTENTION, peft_lora
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

SHAPE = {"height": 48, "width": 64, "num_frames": 5}


# -- the recipes' samplers, transcribed ------------------------------------------------------------
# Both are diffusers-shaped schedulers (set_timesteps / timesteps / step), so diffusers' own Wan
# pipelines run them; each draws its fresh noise from the generator the pipeline drew the initial
# latents from, as the recipes do (one generator per request, on the CPU here).


class _PipelineScheduler:
    """What diffusers' Wan pipelines call on a scheduler beside set_timesteps / timesteps / step."""

    order = 1

    def set_begin_index(self, begin_index: int = 0) -> None:
        pass  # each transcription counts its own steps


class LightX2VStepDistill(_PipelineScheduler):
    """ModelTC/LightX2V lightx2v/models/schedulers/wan/step_distill/scheduler.py, WanStepDistillScheduler:
    set_denoising_timesteps and step_post."""

    def __init__(self, denoising_step_list, sample_shift, generator):
        self.denoising_step_list, self.sample_shift, self.generator = list(denoising_step_list), sample_shift, generator
        self.num_train_timesteps, self.sigma_max, self.sigma_min = 1000, 1.0, 0.0

    def set_timesteps(self, num_inference_steps, device=None):
        assert num_inference_steps == len(self.denoising_step_list)
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
        x = sample.to(torch.float32) - sigma * flow_pred
        if self.step_index < len(self.denoising_step_list) - 1:
            sigma_next = self.sigmas[self.step_index + 1].item()
            noise = torch.randn(x.shape, dtype=torch.float32, generator=self.generator)
            x = ((1 - sigma_next) * x + sigma_next * noise).type_as(noise)  # add_noise
        self.step_index += 1
        return (x.to(sample.dtype),)


class FastVideoDmd(_PipelineScheduler):
    """hao-ai-lab/FastVideo fastvideo/pipelines/basic/wan/stages/dmd.py, DmdDenoisingStage (SDE sampling,
    scheduler-space labels) over its training-noise FlowMatchEulerDiscreteScheduler(shift=flow_shift):
    the labels become the scheduler's sigmas, x0 = x - sigma_t * v with sigma_t looked up by nearest
    timestep (pred_noise_to_pred_video), then add_noise to the next label with fresh noise."""

    def __init__(self, dmd_denoising_steps, flow_shift, generator):
        self.steps, self.generator = list(dmd_denoising_steps), generator
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=flow_shift)

    def set_timesteps(self, num_inference_steps, device=None):
        assert num_inference_steps == len(self.steps)
        shift = float(self.scheduler.shift)
        shifted = torch.tensor(self.steps, dtype=torch.long).float() / self.scheduler.config.num_train_timesteps
        sigmas = shifted / (shift - (shift - 1.0) * shifted)  # _set_dmd_timesteps(scheduler_space=True)
        self.scheduler.set_timesteps(sigmas=sigmas.tolist(), device=device)
        self.timesteps, self.sigmas = self.scheduler.timesteps, self.scheduler.sigmas
        self.step_index = 0

    def _sigma(self, t):
        index = torch.argmin((self.scheduler.timesteps.float() - t.float()).abs())
        return self.scheduler.sigmas[index].float()

    def step(self, model_output, timestep, sample, return_dict=False):
        pred_video = sample.float() - self._sigma(timestep) * model_output.float()
        if self.step_index < len(self.steps) - 1:
            noise = torch.randn(sample.shape, dtype=pred_video.dtype, generator=self.generator)
            sigma_next = self._sigma(self.timesteps[self.step_index + 1])
            latents = ((1 - sigma_next) * pred_video + sigma_next * noise).type_as(noise)
        else:
            latents = pred_video
        self.step_index += 1
        return (latents,)


def _lightx2v(card, generator):
    config = card.recipe.sampler.config
    return LightX2VStepDistill([int(t) for t in config["timesteps"]], config["flow_shift"], generator)


def _reference(pipe, scheduler_for, seed: int, prompt_embeds, **call):
    """diffusers' pipeline with the transcribed sampler, one branch (guidance 1), as the recipes run."""
    generator = torch.Generator().manual_seed(seed)
    pipe.scheduler = scheduler_for(generator)
    return pipe(prompt_embeds=prompt_embeds, guidance_scale=1.0, generator=generator, output_type="latent", **call).frames


def _embeds(engine, seed: int) -> torch.Tensor:
    return torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=torch.Generator().manual_seed(seed))


def _image(seed: int) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def t2v_checkpoint(tmp_path_factory):
    """tiny-wan's seeded weights written by diffusers' WanPipeline (what the released cards load)."""
    card = get_card("tiny-wan")
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(WanPipeline, c, tmp_path_factory.mktemp("tiny-t2v"), scheduler=diffusers_scheduler(card.recipe.sampler))


@pytest.fixture(scope="module")
def distill_lora(tmp_path_factory):
    """A random LoRA on tiny-wan's attention projections, in diffusers' layout (the LightX2V file's role)."""
    return peft_lora(tmp_path_factory.mktemp("distill-lora"), seed=3, targets=ATTENTION, rank=4, alpha=4.0)


@pytest.fixture(scope="module")
def tiny_4step():
    return Engine.from_card("tiny-wan-4step", device="cpu")


# -- each card against its recipe's sampler ------------------------------------------------------


def test_tiny_4step_matches_lightx2v_sampler_on_wan_pipeline(tiny_4step, t2v_checkpoint):
    pipe = reference_pipeline(WanPipeline, t2v_checkpoint)  # tiny-wan's weights, untouched
    assert_shares_no_storage(tiny_4step, pipe)
    positive = _embeds(tiny_4step, 1)
    reference = _reference(pipe, lambda g: _lightx2v(tiny_4step.card, g), 7, positive, num_inference_steps=4, **SHAPE)
    [result] = tiny_4step.generate([Request(prompt_embeds=positive, seed=7, output_type="latent", **SHAPE)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)
    assert result.provenance["recipe"]["name"] == "lightx2v-4step" and result.provenance["recipe"]["method"] == "step_cfg_distilled"


def test_lightx2v_lora_card_matches_diffusers_lora_loader_and_lightx2v_sampler(t2v_checkpoint, distill_lora, tmp_path):
    card = get_card("wan2.1-t2v-14b-lightx2v-4step")
    engine = Engine.from_card(card, checkpoint=t2v_checkpoint, device="cpu", dtype="fp32",
                              loras={"lightx2v_4step": distill_lora})  # fmt: skip
    pipe = reference_pipeline(WanPipeline, t2v_checkpoint)
    pipe.load_lora_weights(str(distill_lora))  # diffusers' own loader, at the recipe's strength 1.0
    assert_shares_no_storage(engine, pipe)
    positive = _embeds(engine, 2)
    reference = _reference(pipe, lambda g: _lightx2v(card, g), 11, positive, num_inference_steps=4, **SHAPE)
    [result] = engine.generate([Request(prompt_embeds=positive, seed=11, output_type="latent", **SHAPE)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)
    assert result.provenance["merged_loras"] == {"lightx2v_4step": 1.0}

    # The merged-weights variant: a checkpoint with the distill fused in (by diffusers), no LoRA file.
    pipe.fuse_lora(lora_scale=1.0)
    pipe.unload_lora_weights()
    merged = tmp_path / "merged"
    pipe.save_pretrained(merged)
    engine = Engine.from_card("wan2.1-t2v-14b-lightx2v-4step-merged", checkpoint=merged, device="cpu", dtype="fp32")
    [again] = engine.generate([Request(prompt_embeds=positive, seed=11, output_type="latent", **SHAPE)])
    assert again.ok, again.error
    assert_matches_reference(again.latents, reference)


def test_lora_distill_card_without_its_lora_says_which_file(t2v_checkpoint):
    with pytest.raises(AdapterError, match=r"wan2\.1_t2v_14b_lora_rank64_lightx2v_4step\.safetensors.*loras=\{'lightx2v_4step': PATH\}"):
        Engine.from_card("wan2.1-t2v-14b-lightx2v-4step", checkpoint=t2v_checkpoint, device="cpu", dtype="fp32")


def test_fastwan_matches_fastvideo_dmd_sampler(t2v_checkpoint):
    card = get_card("fastwan2.1-t2v-1.3b")
    engine = Engine.from_card(card, checkpoint=t2v_checkpoint, device="cpu", dtype="fp32")
    pipe = reference_pipeline(WanPipeline, t2v_checkpoint)
    assert_shares_no_storage(engine, pipe)
    positive = _embeds(engine, 3)
    # FastVideo's FastWan config: dmd_denoising_steps [1000, 757, 522] in scheduler space, flow_shift 8.
    reference = _reference(pipe, lambda g: FastVideoDmd([1000, 757, 522], 8.0, g), 5, positive, num_inference_steps=3, **SHAPE)
    [result] = engine.generate([Request(prompt_embeds=positive, seed=5, output_type="latent", **SHAPE)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)


def test_lightx2v_i2v_card_matches_wan_image_to_video_pipeline(tmp_path_factory):
    card = get_card("tiny-wan-i2v")
    c = load_components(card, None, torch.device("cpu"))
    folder = saved_pipeline(WanImageToVideoPipeline, c, tmp_path_factory.mktemp("tiny-i2v"),
                            scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip
    lora = peft_lora(tmp_path_factory.mktemp("i2v-lora"), seed=4, targets=ATTENTION, card="tiny-wan-i2v")
    distilled = get_card("wan2.1-i2v-14b-480p-lightx2v-4step")
    engine = Engine.from_card(distilled, checkpoint=folder, device="cpu", dtype="fp32", loras={"lightx2v_4step": lora})
    pipe = reference_pipeline(WanImageToVideoPipeline, folder)
    pipe.load_lora_weights(str(lora))
    assert_shares_no_storage(engine, pipe)
    positive, image = _embeds(engine, 4), _image(2)
    reference = _reference(pipe, lambda g: _lightx2v(distilled, g), 9, positive, image=image, num_inference_steps=4, **SHAPE)
    [result] = engine.generate([Request(image=image, prompt_embeds=positive, seed=9, output_type="latent", **SHAPE)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)


# -- the recipe contract -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, field, rule",
    [
        ({"num_inference_steps": 50}, "num_inference_steps", "it takes exactly 4 steps"),
        ({"num_inference_steps": 8}, "num_inference_steps", r"timesteps \[1000, 750, 500, 250\]"),
        ({"guidance_scale": 5.0}, "guidance_scale", "guidance is distilled"),
        ({"negative_prompt": "blurry"}, "negative_prompt", "negative prompt would be ignored"),
        ({"cache": {"method": "magcache", "threshold": 0.06}}, "cache", "admits no step caching"),
        ({"cache": {"method": "teacache", "threshold": 0.08}}, "cache", "admits no step caching"),
    ],
)
def test_requests_outside_the_recipe_are_rejected_naming_it(tiny_4step, values, field, rule):
    request = Request(prompt="a fox", seed=0, **values)
    with pytest.raises(RequestRejected, match=rule) as caught:
        tiny_4step.start(request)
    assert caught.value.field == field and "recipe 'lightx2v-4step'" in str(caught.value)
    [result] = tiny_4step.generate([request])  # the batch API hands it back rejected, nothing run
    assert result.status == "rejected" and field in result.error


def test_requests_within_the_recipe_run(tiny_4step):
    [result] = tiny_4step.generate([Request(prompt="a fox", seed=0, num_inference_steps=4, guidance_scale=1.0,
                                            cache="none", output_type="latent", **SHAPE)])  # fmt: skip
    assert result.ok, result.error


def test_distilled_recipe_schedule_cannot_be_chosen_over():
    card = get_card("tiny-wan-4step")
    for choice in ({"flow_shift": 3.0}, {"default_steps": 8}):
        with pytest.raises(ValueError, match="distilled on"):
            with_recipe(card, choice)
    with pytest.raises(ValueError, match="default_guidance_scale must be 1.0"):
        with_recipe(card, {"default_guidance_scale": 5.0})


def test_recipe_spec_enforces_the_contract():
    recipe = get_card("tiny-wan-4step").recipe.model_dump()
    with pytest.raises(ValidationError, match="admits no step caching|step_caching must be"):
        RecipeSpec.model_validate({**recipe, "step_caching": None})
    with pytest.raises(ValidationError, match="allows exactly its steps"):
        RecipeSpec.model_validate({**recipe, "allowed_steps": (1, 50)})
    with pytest.raises(ValidationError, match="names its base card"):
        RecipeSpec.model_validate({**recipe, "parents": None})
    with pytest.raises(ValidationError, match="strictly descending"):
        RecipeSpec.model_validate({**recipe, "sampler": {"name": "few_step_renoise", "config": {"timesteps": [250, 500], "flow_shift": 5.0}}})
    with pytest.raises(ValidationError, match="not one recipe"):
        get_card("tiny-wan-4step").model_validate({**get_card("tiny-wan-4step").model_dump(),
                                                   "default_cache": {"method": "magcache", "threshold": 0.06}})  # fmt: skip


# -- the stochastic sampler: reproducible alone, in a batch, across save / resume -------------------


def _run(engine, request, stop_after: int | None = None, folder=None):
    """Step `request` to the end; with `stop_after`, save the state after that many steps and go on
    from the file instead."""
    state = engine.start(request)
    steps = 0
    while engine.step(state):
        steps += 1
        if steps == stop_after:
            path = folder / f"state-{steps}.pt"
            state.save(path)
            state = engine.resume(type(state).load(path))
    return engine.loop.finalize(state)


def test_same_seed_same_latents_across_save_and_resume_at_every_step(tiny_4step, tmp_path):
    request = Request(prompt="a red fox", seed=13, output_type="latent", **SHAPE)
    whole = _run(tiny_4step, request)
    # text encode, then 4 denoise steps: stop after each of the first four launches
    for stop_after in range(1, 5):
        resumed = _run(tiny_4step, request, stop_after, tmp_path)
        assert torch.equal(resumed.latents, whole.latents), f"stopped after {stop_after}"
    other = _run(tiny_4step, Request(prompt="a red fox", seed=14, output_type="latent", **SHAPE))
    assert not torch.allclose(other.latents, whole.latents)  # the noise is the seed's


def test_a_tampered_generator_state_is_refused(tiny_4step, tmp_path):
    state = tiny_4step.start(Request(prompt="a fox", seed=1, output_type="latent", **SHAPE))
    tiny_4step.step(state)
    state.generator_state = torch.zeros(7, dtype=torch.uint8)
    state.save(tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="generator_state"):
        tiny_4step.resume(type(state).load(tmp_path / "bad.pt"))


def test_same_seed_same_latents_alone_and_batched_with_others():
    """Compiled (aot_eager) with a bucket of 3: one request alone, then beside two others that started
    two steps earlier; its latents are the same, and equal the eager engine's."""
    engine = Engine.from_card("tiny-wan-4step", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                              buckets=BucketSpec(batch_sizes=(1, 3)))  # fmt: skip
    mine = Request(prompt="a red fox", seed=21, output_type="latent", **SHAPE)
    [alone] = engine.generate([mine])
    for prompt, seed in (("snow", 3), ("a cat", 4)):
        engine.submit(Request(prompt=prompt, seed=seed, output_type="latent", **SHAPE))
    engine.tick()
    engine.tick()  # the others are ahead: the batches below mix steps of three requests
    mine_id = engine.submit(mine)
    before = engine.counters.snapshot()
    results = {}
    while engine.has_work():
        results.update((r.request_id, r) for r in engine.tick())
    grew = engine.counters.since(before)
    assert grew["compiled_steps"] > grew["batches"]  # some batches ran more than one request's step
    eager = _run(Engine.from_card("tiny-wan-4step", device="cpu"), mine)
    torch.testing.assert_close(results[mine_id].latents, alone.latents, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(alone.latents, eager.latents, atol=1e-5, rtol=1e-4)


def test_http_serves_the_recipe_and_refuses_outside_it(tiny_4step, tmp_path):
    """Over HTTP: a video at the recipe's defaults is made; 30 steps or a guidance scale are a 400
    naming the field and the recipe, and nothing is stored for them."""
    from http_helpers import KEY, httpx, live_server

    headers = {"Authorization": f"Bearer {KEY}"}
    with live_server(tiny_4step, tmp_path) as (srv, url):
        for field, extra in (("num_inference_steps", {"num_inference_steps": 30}), ("guidance_scale", {"guidance_scale": 6.0})):
            response = httpx.post(url + "/v1/videos", headers=headers, json={"prompt": "x", "size": "64x48", **extra})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == field and "lightx2v-4step" in error["message"], error
        assert len(srv.store) == 0
        response = httpx.post(url + "/v1/videos", headers=headers, json={"prompt": "a fox", "size": "64x48", "seed": 1})
        assert response.status_code == 200, response.text
