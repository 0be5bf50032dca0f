"""The cached denoise kinds carry CFG-branch markers: traced with the fusion pass, their two denoiser
calls are one at twice the batch (keep: the blocks once; reuse: the embedders and output head once),
with the same numbers as the unfused graph."""

import pytest
import torch
import torch.nn.functional as F

from fvgraph.compile.step_capture import capture_step
from fvgraph.passes.base import PassContext, marker_nodes
from fvgraph.passes.cfg_fusion import CfgFusionPass
from fvgraph.request import Request

STEPS = 4
CACHE = {"method": "magcache", "threshold": 0.5, "max_skip_steps": 2, "mag_ratios": [1.0] + [0.99] * (STEPS - 1)}


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _fused(step, plan_kind, cap):
    """The step traced under CFG fusion at the unfused capture's inputs, and the pass run on it."""
    fusion = CfgFusionPass()
    with fusion.tracing(step):
        traced = capture_step(plan_kind, step, dict(zip(cap.input_names, cap.example_args[cap.num_params :])))
    ctx = PassContext(root=step, example_args=traced.example_args, num_params=traced.num_params)
    return fusion(traced.gm, ctx), ctx


@pytest.fixture(scope="module")
def captured(tiny_engine):
    """The keep step (step 0) and the reuse step (step 1) of one cached CFG request, captured."""
    state = tiny_engine.start(Request(prompt="a lantern", seed=5, num_inference_steps=STEPS, num_frames=5, cache=CACHE))
    steps = {}
    while len(steps) < 2:
        plan = tiny_engine.loop.next(state)
        if plan.kind in ("denoise_cfg_keep", "denoise_cfg_reuse") and plan.kind not in steps:
            step = tiny_engine.executor.steps[plan.kind]
            steps[plan.kind] = (step, capture_step(plan.kind, step, plan.inputs))
        tiny_engine.step(state)
    return steps


@pytest.mark.parametrize("kind, target, per_call", [("denoise_cfg_keep", F.scaled_dot_product_attention, "attention"),
                                                    ("denoise_cfg_reuse", F.linear, "linear")])  # fmt: skip
def test_cfg_fusion_fuses_the_cached_kinds(captured, tiny_card, kind, target, per_call):
    step, cap = captured[kind]
    before = _count(cap.gm, target)
    markers = marker_nodes(cap.gm.graph, torch.ops.fvgraph.branch_output)
    assert sorted((n.args[1], n.args[3]) for n in markers) == [("cond", 0), ("cond", 1), ("uncond", 0), ("uncond", 1)]
    fused, ctx = _fused(step, kind, cap)
    assert ctx.changed["cfg_fusion"] == 2  # one fused call, its two outputs (noise, residual) split back
    assert before > 0 and _count(fused, target) == before // 2  # one denoiser call's worth of `per_call` ops
    tol = tiny_card.parity.tolerance("fp32", "component")
    with torch.no_grad():
        ours, reference = fused(*cap.example_args), cap.gm(*cap.example_args)
    assert len(ours) == len(reference) == len(cap.output_names)  # latents, sampler history, kept residuals (keep)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol)


def test_cfg_fusion_fuses_taylorseers_keep_kind(tiny_engine, tiny_card):
    """TaylorSeer's full step marks its denoiser calls as the plain step does: the pass halves its
    attention calls and the fused graph returns the same latents and features."""
    request = Request(prompt="a lantern", seed=5, num_inference_steps=STEPS, num_frames=5, cache={"method": "taylorseer"})
    state = tiny_engine.start(request)
    while (plan := tiny_engine.loop.next(state)).kind != "denoise_cfg_taylor_keep":
        tiny_engine.step(state)
    step = tiny_engine.executor.steps[plan.kind]
    cap = capture_step(plan.kind, step, plan.inputs)
    before = _count(cap.gm, F.scaled_dot_product_attention)
    fused, _ = _fused(step, plan.kind, cap)
    assert before > 0 and _count(fused, F.scaled_dot_product_attention) == before // 2
    tol = tiny_card.parity.tolerance("fp32", "component")
    with torch.no_grad():
        for a, b in zip(fused(*cap.example_args), cap.gm(*cap.example_args), strict=True):
            torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol)
