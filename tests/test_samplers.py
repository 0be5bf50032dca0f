"""The tensor-form samplers follow diffusers' schedulers step for step."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_calculate_shift

from fvgraph.card import SamplerSpec
from fvgraph.loops.samplers import build_sampler, calculate_shift, num_coeffs

UNIPC = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}


def _trajectory(sampler, reference, steps: int, batch_rows: int = 1):
    """Run a linear 'model' through both; the fvgraph side uses per-row coefficient tensors."""
    plan = sampler.plan(steps)
    reference.set_timesteps(steps)
    assert torch.equal(plan.timesteps, reference.timesteps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_rows, 4, 2, 3, 3, generator=g)
    weight = torch.randn(4, 4, generator=g) * 0.3
    model = lambda s, t: torch.einsum("ij,bj...->bi...", weight, s) + 0.1 * t / 1000  # noqa: E731
    ours, theirs, carry = x.clone(), x.clone(), sampler.initial_carry(x)
    for i, t in enumerate(reference.timesteps):
        coeffs = plan.coeffs[i : i + 1].expand(batch_rows, -1)
        ours, carry = sampler.update(ours, model(ours, t), carry, coeffs)
        theirs = reference.step(model(theirs, t), t, theirs, return_dict=False)[0]
    return ours, theirs


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("steps", [1, 2, 5, 12])
def test_unipc_matches_diffusers(order, steps):
    config = {**UNIPC, "solver_order": order}
    sampler = build_sampler(SamplerSpec(name="unipc", config=config))
    ours, theirs = _trajectory(sampler, UniPCMultistepScheduler(**config), steps)
    torch.testing.assert_close(ours, theirs, atol=5e-6, rtol=1e-5)


def test_unipc_disable_corrector_and_bh1_match_diffusers():
    # bh1 with a final sigma of zero divides by infinity in diffusers (NaN); end at sigma_min instead.
    config = {**UNIPC, "solver_type": "bh1", "disable_corrector": [1, 3], "final_sigmas_type": "sigma_min"}
    sampler = build_sampler(SamplerSpec(name="unipc", config=config))
    ours, theirs = _trajectory(sampler, UniPCMultistepScheduler(**config), 6)
    torch.testing.assert_close(ours, theirs, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_flow_euler_is_bit_identical_to_diffusers(steps):
    sampler = build_sampler(SamplerSpec(name="flow_euler", config={"shift": 5.0}))
    ours, theirs = _trajectory(sampler, FlowMatchEulerDiscreteScheduler(shift=5.0), steps)
    assert torch.equal(ours, theirs)


def test_rows_of_one_batch_can_sit_at_different_steps():
    """Per-row coefficients: a batch mixing step 0 and step 3 equals each row run on its own."""
    sampler = build_sampler(SamplerSpec(name="unipc", config=UNIPC))
    plan = sampler.plan(6)
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 4, 1, 2, 2, generator=g), torch.randn(2, 4, 1, 2, 2, generator=g)
    carry = tuple(torch.randn(2, 4, 1, 2, 2, generator=g) for _ in sampler.initial_carry(x))
    rows = torch.stack([plan.coeffs[0], plan.coeffs[3]])
    batched, batched_carry = sampler.update(x, v, carry, rows)
    for r in range(2):
        alone, alone_carry = sampler.update(x[r : r + 1], v[r : r + 1], tuple(c[r : r + 1] for c in carry), rows[r : r + 1])
        assert torch.equal(batched[r : r + 1], alone)
        assert all(torch.equal(b[r : r + 1], a) for b, a in zip(batched_carry, alone_carry))
    assert plan.coeffs.shape[1] == num_coeffs(sampler)


def test_unsupported_unipc_config_is_rejected_with_reason():
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        build_sampler(SamplerSpec(name="unipc", config={"prediction_type": "epsilon"}))


@pytest.mark.parametrize("image_seq_len", [16, 256, 1024, 4096, 8192])
@pytest.mark.parametrize("config", [{}, {"base_seq_len": 64, "max_seq_len": 1024, "base_shift": 0.3, "max_shift": 2.0}])
def test_calculate_shift_equals_diffusers(image_seq_len, config):
    assert calculate_shift(image_seq_len, **config) == diffusers_calculate_shift(image_seq_len, **config)
