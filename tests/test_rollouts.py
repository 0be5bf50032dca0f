"""RL rollouts on the serving loop: Flow-GRPO's SDE step and its log-prob as the engine runs them,
transcribed here from flow_grpo; grouped rollouts that share one text encode and batch; behaviour
records; log-probs recomputed with the model in train mode (the C2 rung); weight sync with nothing
recompiled and no request mixing two versions."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from diffusers.utils.torch_utils import randn_tensor
from pydantic import ValidationError

from fvgraph.behavior import BehaviorRecord
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.loops.samplers import FlowSdeSampler
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request, RequestRejected
from fvgraph.runtime.buckets import BucketSpec
from reference_helpers import assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline

SHAPE = {"height": 48, "width": 64, "num_frames": 5, "num_inference_steps": 4}


def flow_grpo_sde_step_with_logprob(scheduler, model_output, timestep, sample, noise_level=0.7, prev_sample=None,
                                    generator=None):  # fmt: skip
    """flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_step_with_logprob (calculate_pb=False)."""
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [scheduler.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = scheduler.sigmas[step_index].view(-1, *([1] * (sample.dim() - 1)))
    sigma_prev = scheduler.sigmas[prev_step_index].view(-1, *([1] * (sample.dim() - 1)))
    sigma_max = scheduler.sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        variance_noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


class FlowGrpoScheduler:
    """The SDE step as a scheduler for diffusers' WanPipeline, as flow_grpo's Wan pipeline with logprob
    runs it: diffusers' FlowMatchEulerDiscreteScheduler sigmas, one noise draw per step from the
    pipeline's generator, and each step's latents and log-prob kept."""

    order = 1

    def __init__(self, shift: float, noise_level: float, generator: torch.Generator):
        self.inner = FlowMatchEulerDiscreteScheduler(shift=shift)
        self.noise_level, self.generator = noise_level, generator
        self.latents, self.log_probs = [], []

    def set_timesteps(self, num_inference_steps, device=None):
        self.inner.set_timesteps(num_inference_steps, device=device)
        self.timesteps, self.sigmas = self.inner.timesteps, self.inner.sigmas

    def set_begin_index(self, begin_index=0):
        pass

    def step(self, model_output, timestep, sample, return_dict=False):
        if not self.latents:
            self.latents.append(sample.clone())
        prev, log_prob, _, _ = flow_grpo_sde_step_with_logprob(self.inner, model_output, timestep.reshape(1), sample,
                                                               self.noise_level, generator=self.generator)  # fmt: skip
        self.latents.append(prev)
        self.log_probs.append(log_prob)
        return (prev,)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card("tiny-wan", device="cpu")


def _embeds(engine, seed: int, n: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, engine.card.shapes.text_len, engine.facts.text_dim, generator=g) for _ in range(n)]


# -- the SDE step against flow_grpo ---------------------------------------------------------------


@pytest.mark.parametrize("noise_level", [0.7, 1.0])
def test_sde_step_and_log_prob_equal_flow_grpo_on_the_same_inputs(noise_level):
    steps, shift = 6, 3.0
    ours = FlowSdeSampler(shift)
    plan = ours.plan(steps, noise_level)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    assert torch.equal(plan.timesteps, scheduler.timesteps)
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(scheduler.timesteps):
        sample, velocity = torch.randn(2, 16, 3, 4, 4, generator=g), torch.randn(2, 16, 3, 4, 4, generator=g)
        noise = torch.randn(sample.shape, generator=torch.Generator().manual_seed(i))
        want, want_lp, _, _ = flow_grpo_sde_step_with_logprob(scheduler, velocity, t.repeat(2), sample, noise_level,
                                                              generator=torch.Generator().manual_seed(i))  # fmt: skip
        got, _, got_lp = ours.update(sample, velocity, (), plan.coeffs[i].repeat(2, 1), noise)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(got_lp, want_lp, atol=2e-5, rtol=1e-5)
        # and the log-prob of a transition given from outside (what a trainer recomputes)
        _, given_lp, _, _ = flow_grpo_sde_step_with_logprob(scheduler, velocity, t.repeat(2), sample, noise_level, prev_sample=got)
        torch.testing.assert_close(got_lp, given_lp, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])
def test_rollout_equals_flow_grpo_sampling_on_wan_pipeline(engine, tmp_path, guidance_scale):
    card = get_card("tiny-wan")
    folder = saved_pipeline(WanPipeline, load_components(card, None, torch.device("cpu")), tmp_path / "ckpt",
                            scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip
    pipe = reference_pipeline(WanPipeline, folder)
    assert_shares_no_storage(engine, pipe)
    positive, negative = _embeds(engine, 3)
    generator = torch.Generator().manual_seed(4)
    pipe.scheduler = FlowGrpoScheduler(3.0, 0.7, generator)  # tiny-wan's UniPC flow_shift 3.0
    pipe(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale, generator=generator,
         output_type="latent", **SHAPE)  # fmt: skip
    [result] = engine.generate([Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=guidance_scale,
                                        seed=4, rollout={"noise_level": 0.7}, output_type="latent", **SHAPE)])  # fmt: skip
    assert result.ok, result.error
    record = result.record
    assert record.latents.shape[0] == SHAPE["num_inference_steps"] + 1
    assert_matches_reference(record.latents, torch.cat(pipe.scheduler.latents))
    torch.testing.assert_close(record.log_probs, torch.cat(pipe.scheduler.log_probs), atol=1e-4, rtol=1e-5)
    assert torch.equal(result.latents, record.latents[-1:])


# -- groups, records, rejections ------------------------------------------------------------------


def test_a_group_encodes_once_and_batched_equals_alone_bit_for_bit(engine):
    kinds = []
    records = engine.rollout(["a red fox in snow"], group_size=8, seed=11, on_step=lambda s, kind: kinds.append(kind),
                             **SHAPE)  # fmt: skip
    assert kinds.count("text_encode") == 1 and kinds.count("denoise_sde_cfg") == 8 * SHAPE["num_inference_steps"]
    assert len(records) == 8 and {r.group for r in records} == {0} and len({r.seed for r in records}) == 8
    for record in records[:3]:  # each sample alone, from its record's seed and conditioning
        [alone] = engine.generate([Request(prompt_embeds=record.prompt_embeds, negative_prompt_embeds=record.negative_prompt_embeds,
                                           seed=record.seed, rollout={"noise_level": 0.7}, output_type="latent", **SHAPE)])  # fmt: skip
        assert torch.equal(alone.record.latents, record.latents) and torch.equal(alone.record.log_probs, record.log_probs)


def test_compiled_groups_batch_and_match_eager(engine):
    compiled = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                buckets=BucketSpec(batch_sizes=(4,)))  # fmt: skip
    before = compiled.counters.snapshot()
    records = compiled.rollout(["a fox", "a lighthouse"], group_size=4, seed=5, **SHAPE)
    grew = compiled.counters.since(before)
    assert grew["compiled_steps"] == 8 * SHAPE["num_inference_steps"] and grew["batches"] == 2 * SHAPE["num_inference_steps"]
    eager = engine.rollout(["a fox", "a lighthouse"], group_size=4, seed=5, **SHAPE)
    for got, want in zip(records, eager):
        assert got.seed == want.seed
        torch.testing.assert_close(got.latents, want.latents, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-4, rtol=1e-4)


def test_record_saves_and_loads(engine, tmp_path):
    [record] = engine.rollout(["a fox"], group_size=1, seed=2, **SHAPE)
    loaded = BehaviorRecord.load(record.save(tmp_path / "r.safetensors"))
    for name in ("timesteps", "coeffs", "latents", "log_probs", "prompt_embeds", "negative_prompt_embeds"):
        assert torch.equal(getattr(loaded, name), getattr(record, name)), name
    assert loaded.provenance == record.provenance and loaded.seed == record.seed and loaded.group == 0
    assert {"weights_version", "precision", "opt_level", "attention_backend", "parallel", "loras"} <= set(record.provenance)
    (tmp_path / "bad.safetensors").write_bytes(b"not a record")
    with pytest.raises(ValueError, match="not a saved BehaviorRecord"):
        BehaviorRecord.load(tmp_path / "bad.safetensors")


def test_rollouts_outside_their_scope_are_refused(engine):
    with pytest.raises(ValidationError, match="rollout with cache"):
        Request(prompt="x", rollout={"noise_level": 0.7}, cache={"method": "magcache", "threshold": 0.06})
    with pytest.raises(ValidationError):
        Request(prompt="x", rollout={"noise_level": 0.0})
    distilled = Engine.from_card("tiny-wan-4step", device="cpu")
    with pytest.raises(RequestRejected, match="rollouts sample base recipes") as caught:
        distilled.start(Request(prompt="x", rollout={"noise_level": 0.7}))
    assert caught.value.field == "rollout"
    with pytest.raises(ValueError, match="sets prompt_embeds itself"):
        engine.rollout(["x"], group_size=2, seed=1, prompt_embeds=torch.zeros(4, 32))
    with pytest.raises(ValueError, match="group_size"):
        engine.rollout(["x"], group_size=0, seed=1)


def test_a_saved_rollout_resumes_with_its_record(engine, tmp_path):
    request = Request(prompt="a red fox", seed=9, rollout={"noise_level": 0.7}, output_type="latent", **SHAPE)
    [whole] = engine.generate([request])
    state = engine.start(request)
    for _ in range(3):  # text encode and two transitions
        engine.step(state)
    state.save(tmp_path / "s.pt")
    resumed = engine.finish(engine.resume(type(state).load(tmp_path / "s.pt")))
    assert torch.equal(resumed.record.latents, whole.record.latents) and torch.equal(resumed.record.log_probs, whole.record.log_probs)
    state.rollout.log_probs = state.rollout.log_probs[:1]  # one transition's log-prob lost
    state.save(tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"rollout\.log_probs"):
        engine.resume(type(state).load(tmp_path / "bad.pt"))


# -- the C2 rung: recorded log-probs == train-forward log-probs ------------------------------------


def recompute_log_probs(transformer, record: BehaviorRecord, shift: float) -> torch.Tensor:
    """Each recorded transition's log-prob from the model in train mode (autograd on), as a trainer
    computes it: diffusers' transformer on the recorded latents, the CFG combine, flow_grpo's step
    with prev_sample given."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(record.num_steps)
    transformer.train()
    out = []
    with torch.enable_grad():
        for i, t in enumerate(scheduler.timesteps):
            x = record.latents[i : i + 1]
            cond = transformer(x, t.reshape(1), record.prompt_embeds[None], return_dict=False)[0]
            v = cond
            if record.guidance_scale > 1:
                uncond = transformer(x, t.reshape(1), record.negative_prompt_embeds[None], return_dict=False)[0]
                v = uncond + record.guidance_scale * (cond - uncond)
            _, log_prob, _, _ = flow_grpo_sde_step_with_logprob(scheduler, v, t.reshape(1), x, record.noise_level,
                                                                prev_sample=record.latents[i + 1 : i + 2])  # fmt: skip
            out.append(log_prob)
    transformer.eval()
    return torch.cat(out)


@pytest.mark.parametrize("level", [0, 1])
def test_recorded_log_probs_equal_train_forward_log_probs(level, capsys):
    """C2: at -O0 the serve forward is the train forward's ops (measured |diff| 0 at every step); at -O1
    inductor's compiled step rounds differently (measured at most 1.2e-7 per step on tiny-wan, two
    seeds, CPU). The bound, for both, is 1e-6: about eight times that (the SDE mean is formed in
    another order on the two sides, so a CPU with other vector widths may round it apart at -O0 too);
    the per-step differences are printed."""
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=level)  # -O1: inductor, the level as served
    [record] = engine.rollout(["a red fox"], group_size=1, seed=3, **SHAPE)
    trainer_side = load_components(get_card("tiny-wan"), None, torch.device("cpu")).transformer.requires_grad_(True)  # untouched weights
    recomputed = recompute_log_probs(trainer_side, record, shift=3.0)
    assert recomputed.requires_grad  # the train forward, differentiable
    diff = (recomputed.detach() - record.log_probs).abs()
    with capsys.disabled():
        print(f"\n-O{level} recorded vs train-forward log-prob |diff| per step: {[f'{d:.2e}' for d in diff.tolist()]}")
    assert diff.max() <= 1e-6, diff


# -- weight sync -----------------------------------------------------------------------------------


def _new_weights(engine, scale: float = 1.05) -> dict[str, torch.Tensor]:
    return {name: p.detach() * scale for name, p in engine.loop.components.transformer.named_parameters() if "ffn" in name}


def test_update_weights_next_request_uses_them_and_nothing_recompiles():
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                              buckets=BucketSpec(batch_sizes=(1,)))  # fmt: skip
    request = Request(prompt="a fox", seed=1, rollout={"noise_level": 0.7}, output_type="latent", **SHAPE)
    [before] = engine.warmup([request])  # compiles, then fail_on_recompile
    weights = _new_weights(engine)
    storage = {name: p.data_ptr() for name, p in engine.loop.components.transformer.named_parameters()}
    compiles = engine.counters.compiles
    report = engine.update_weights(weights, version="trained-1")
    [after] = engine.generate([request])
    assert report["version"] == "trained-1" and engine.counters.compiles == compiles  # nothing recompiled
    assert storage == {name: p.data_ptr() for name, p in engine.loop.components.transformer.named_parameters()}
    assert after.record.provenance["weights_version"] == "trained-1" and before.record.provenance["weights_version"] != "trained-1"
    assert not torch.allclose(after.latents, before.latents)
    fresh = Engine.from_card("tiny-wan", device="cpu")  # eager, on the same new weights
    fresh.loop.components.transformer.load_state_dict(weights, strict=False)
    [reference] = fresh.generate([request])
    torch.testing.assert_close(after.latents, reference.latents, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("in_flight", ["finish", "stop"])
def test_a_request_in_flight_never_mixes_two_versions(in_flight):
    engine = Engine.from_card("tiny-wan", device="cpu")
    request = Request(prompt="a fox", seed=1, rollout={"noise_level": 0.7}, output_type="latent", **SHAPE)
    [old] = engine.generate([request])
    old_version = engine.loop.components.weights_version
    engine.submit(request)
    engine.tick()
    engine.tick()  # mid-run: text encoded, one transition taken
    report = engine.update_weights(_new_weights(engine), version="v2", in_flight=in_flight)
    [ended] = engine.tick()
    assert report[{"finish": "finished", "stop": "stopped"}[in_flight]] == [request.request_id]
    if in_flight == "finish":
        assert ended.ok and ended.record.provenance["weights_version"] == old_version
        assert torch.equal(ended.latents, old.latents)  # all on the old weights
    else:
        assert ended.status == "cancelled"
    [new] = engine.generate([request])
    assert new.record.provenance["weights_version"] == "v2" and not torch.equal(new.latents, old.latents)


def test_update_weights_refuses_bad_weights_and_changes_nothing(engine):
    version = engine.loop.components.weights_version
    some = next(iter(engine.loop.components.transformer.state_dict()))
    with pytest.raises(KeyError, match="not a parameter"):
        engine.update_weights({"nope.weight": torch.zeros(1)}, version="x")
    with pytest.raises(ValueError, match="must be a tensor of shape"):
        engine.update_weights({some: torch.zeros(1)}, version="x")
    with pytest.raises(ValueError, match="new, non-empty name"):
        engine.update_weights({}, version=version)
    assert engine.loop.components.weights_version == version
