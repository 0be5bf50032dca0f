"""Pass tests, all the same shape: a captured tiny denoise step, the pass, node counts, numerics."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fvgraph.passes.base import PassContext
from fvgraph.passes.cfg_fusion import CfgFusionPass
from fvgraph.passes.cleanup import CleanupPass
from fvgraph.passes.hoist_invariants import HoistInvariantsPass
from fvgraph.passes.manager import PassConfig, PassManager
from fvgraph.request import Request
from fvgraph.compile.step_capture import GraphBreakError, capture_step


@pytest.fixture(scope="module")
def captured(tiny_engine):
    """The tiny-wan denoise_cfg step at its third step, captured once for the module."""
    state = tiny_engine.start(Request(prompt="a lantern", seed=5, num_inference_steps=4, num_frames=5))
    for _ in range(3):
        tiny_engine.step(state)
    plan = tiny_engine.loop.next(state)
    step = tiny_engine.executor.steps[plan.kind]
    return step, capture_step(plan.kind, step, plan.inputs)


def _context(step, cap):
    return PassContext(root=step, example_args=cap.example_args, num_params=cap.num_params)


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _run(gm, args):
    with torch.no_grad():
        return gm(*args)


def test_cfg_fusion_runs_the_denoiser_once(captured, tiny_card):
    """Traced under the pass's `tracing`, the step calls its denoiser once on both branches; the graph
    gives the unfused graph's outputs, and the step module is left unfused for eager calls."""
    step, cap = captured
    layers = step.transformer.config.num_layers
    assert _count(cap.gm, F.scaled_dot_product_attention) == 2 * 2 * layers  # self + cross, per block, per branch
    fusion = CfgFusionPass()
    with fusion.tracing(step):
        traced = capture_step("denoise_cfg", step, dict(zip(cap.input_names, cap.example_args[cap.num_params :])))
    assert step.fuse_branches is False
    # the weights are arguments of the graph, never constants baked in (a weight sync reuses it)
    assert not [n for n in traced.gm.graph.nodes if n.op == "get_attr"]
    ctx = _context(step, traced)
    fused = fusion(traced.gm, ctx)
    assert _count(fused, F.scaled_dot_product_attention) == 2 * layers  # one forward's worth
    assert ctx.changed["cfg_fusion"] == 1  # one fused call, one output
    tol = tiny_card.parity.tolerance("fp32", "component")
    for ours, reference in zip(_run(fused, cap.example_args), _run(cap.gm, cap.example_args), strict=True):
        torch.testing.assert_close(ours, reference, atol=tol.atol, rtol=tol.rtol)


def test_a_guided_step_at_O1_is_traced_once():
    """The compile of a CFG denoise step traces it with dynamo once: CFG fusion and the other passes
    rewrite the graph that capture produced (the step is traced fused), nothing re-traces it."""
    from torch._dynamo.utils import counters

    from fvgraph.compile.compiler import CompileConfig
    from fvgraph.engine.engine import Engine

    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1,
                              compile_config=CompileConfig(backend="aot_eager", step_kinds=("denoise_cfg",)))  # fmt: skip
    request = Request(prompt="a lantern", seed=5, guidance_scale=5.0, num_inference_steps=1, num_frames=5, output_type="latent")
    graphs = counters["stats"]["unique_graphs"]
    with engine.counters.expect(compiles=1, compiled_steps=1):
        [result] = engine.generate([request])
    assert result.ok
    assert counters["stats"]["unique_graphs"] - graphs == 1
    [compiled] = engine.compiler.compiled_steps
    assert compiled.passes_changed["cfg_fusion"] == 1  # ...and that one trace is the fused step


def test_hoisting_moves_text_and_cross_attention_kv_flops_to_the_prologue(captured):
    step, cap = captured
    ctx = _context(step, cap)
    hoisted = HoistInvariantsPass()(_copy(cap), ctx)
    assert ctx.prologue is not None and ctx.hoisted

    flops = lambda gm, args: _flops(gm, args)  # noqa: E731
    before = flops(cap.gm, cap.example_args)
    prologue_out = _run(ctx.prologue, cap.example_args)
    after = flops(hoisted, [*cap.example_args, *prologue_out])
    in_prologue = flops(ctx.prologue, cap.example_args)
    assert in_prologue > 0 and after == before - in_prologue

    # what moved: for each branch the text embedding (2 linears) and K and V of every block
    layers = step.transformer.config.num_layers
    assert len(ctx.hoisted) == 2 * 2 * layers
    for ours, reference in zip(_run(hoisted, [*cap.example_args, *prologue_out]), _run(cap.gm, cap.example_args)):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


def test_cleanup_removes_every_marker(captured):
    step, cap = captured
    ctx = _context(step, cap)
    markers = [n for n in cap.gm.graph.nodes if "fvgraph" in str(n.target)]
    assert len(markers) == 2 * 3 + 2 + 2  # 3 inputs + 1 output per branch, 2 request constants
    cleaned = CleanupPass()(_copy(cap), ctx)
    assert not [n for n in cleaned.graph.nodes if "fvgraph" in str(n.target)]
    assert ctx.changed["cleanup"] == len(markers)
    for ours, reference in zip(_run(cleaned, cap.example_args), _run(cap.gm, cap.example_args)):
        assert torch.equal(ours, reference)


def test_pass_manager_uuid_covers_passes_and_config():
    everything, no_fusion = PassManager(), PassManager(PassConfig(disabled=("cfg_fusion",)))
    assert everything.uuid() != no_fusion.uuid()
    assert [p.name for p in no_fusion.passes] == ["hoist_invariants"]
    with pytest.raises(ValueError, match="unknown pass \\['cfg_fussion'\\]"):
        PassConfig(disabled=("cfg_fussion",))


def test_graph_break_is_an_error_naming_the_step():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum().item() > 0:  # a host decision on data: not one graph
                return {"y": x * 2}
            return {"y": x}

    with pytest.raises(GraphBreakError, match="step 'bad_step' does not trace as one graph"):
        capture_step("bad_step", DataDependent(), {"x": torch.ones(2)})


def _copy(cap):
    """A fresh capture-equivalent graph module per test (passes mutate in place)."""
    import copy

    return copy.deepcopy(cap.gm)


def _flops(gm, args) -> int:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        gm(*args)
    return counter.get_total_flops()


def test_capturing_logs_no_dim_suggestion_traceback():
    """wan-cpu-bench's denoise step made `torch._dynamo.export`'s dynamic-dim suggestion solver fail and
    log a traceback on every capture (torch 2.13); capture no longer exports, so nothing is logged, and
    capture installs no log filter."""
    import logging

    from fvgraph.engine.engine import Engine

    engine = Engine.from_card("wan-cpu-bench", device="cpu")
    g = torch.Generator().manual_seed(0)
    text = torch.randn(engine.card.shapes.text_len, engine.facts.text_dim, generator=g)
    state = engine.start(Request(prompt_embeds=text, negative_prompt_embeds=text.flip(0), seed=1, num_inference_steps=2,
                                 num_frames=1, height=32, width=32))  # fmt: skip
    plan = engine.loop.next(state)
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    seen, filters = [], list(logger.filters)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        capture_step(plan.kind, engine.executor.steps[plan.kind], plan.inputs)
    finally:
        logger.removeHandler(handler)
    assert seen == [] and logger.filters == filters
