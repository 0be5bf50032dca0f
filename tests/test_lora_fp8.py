"""Adapters at -O3: the quantize pass puts each base linear on its FP8 weights and leaves the slot
factors' low-rank GEMMs in the compute dtype; a request with an adapter stays within the card's fp8
tolerance of the same request at -O0 (the eager engine, held to diffusers by test_lora_adapters.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fvgraph
from conftest import embeds
from fvgraph.adapters.slots import LoraSlots
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.compile.step_capture import capture_step
from fvgraph.engine.engine import Engine
from fvgraph.kernels.fp8_weights import apply_fp8_weights
from fvgraph.passes.base import PassContext, step_parameters
from fvgraph.passes.cfg_fusion import CfgFusionPass
from fvgraph.passes.manager import PassConfig, PassManager
from fvgraph.passes.quantize import FP8_LINEAR, FP8_LINEAR_PREQUANT, NORM_MODULATE_QUANT
from lora_files import peft_lora

SHAPE = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 3}
SLOTS = LoraSlots(max_loras=2, max_lora_rank=8, max_loras_per_request=1)
# Every linear of a block: attention projections of both attentions and both FFN linears.
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
FP8_OPS = (FP8_LINEAR, FP8_LINEAR_PREQUANT, NORM_MODULATE_QUANT)
LOW_RANK = (torch.bmm, torch.baddbmm)  # the slot path's two GEMMs (SlotLinear)
SLOT_BUFFERS = ".fvgraph_lora_slots."


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return peft_lora(tmp_path_factory.mktemp("lora") / "a", 1, TARGETS, rank=4, alpha=8.0)


def _request(loras=None):
    positive, negative = embeds(11, get_card("tiny-wan"))
    return fvgraph.Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0, seed=7,
                           output_type="latent", loras=loras, **SHAPE)  # fmt: skip


def _latents(engine, request):
    [result] = engine.generate([request])
    assert result.ok, result.error
    return result.latents


def test_an_adapter_at_o3_stays_within_the_fp8_tolerance_of_o0(lora):
    eager = Engine.from_card("tiny-wan", device="cpu", loras={"a": lora}, lora_slots=SLOTS)
    fp8 = Engine.from_card("tiny-wan", device="cpu", opt_level=3, compile_config=CompileConfig(backend="aot_eager"),
                           loras={"a": lora}, lora_slots=SLOTS)  # fmt: skip
    tol = fp8.card.parity.tolerance("fp8", "loop")
    adapted, base = _latents(eager, _request({"a": 0.8})), _latents(eager, _request())
    ours = _latents(fp8, _request({"a": 0.8}))
    torch.testing.assert_close(ours, adapted, atol=tol.atol, rtol=tol.rtol)
    assert (ours - adapted).abs().max() > 1e-3  # FP8 really ran
    # the adapter moves the result past the tolerance: an -O3 step that dropped it would fail above
    assert (adapted - base).abs().max() > tol.atol + tol.rtol * base.abs().max()
    torch.testing.assert_close(_latents(fp8, _request()), base, atol=tol.atol, rtol=tol.rtol)
    layers = fp8.loop.components.transformer.config.num_layers
    changed = {"lora_index" in step.input_names: step.passes_changed["quantize"] for step in fp8.compiler.compiled_steps}
    # With rows: the 8 step linears of each block on FP8 weights (attn2's K/V are hoisted, full precision),
    # no block prologue fused (the slots' low-rank GEMMs read its output in full precision). Without
    # rows (no adapter in the batch): the base step, its 2 prologues per block fused as without slots.
    assert changed == {True: 8 * layers, False: 8 * layers + 2 * layers}


@pytest.mark.gpu
def test_an_adapter_at_o3_on_cuda_stays_within_the_fp8_tolerance_of_o0(lora):
    """The same on CUDA with inductor: the base GEMMs on `torch._scaled_mm`, the low-rank ones in fp32."""
    from fvgraph.runtime.buckets import BucketSpec

    eager = Engine.from_card("tiny-wan", device="cuda", loras={"a": lora}, lora_slots=SLOTS)
    fp8 = Engine.from_card("tiny-wan", device="cuda", opt_level=3, compile_config=CompileConfig(backend="inductor"),
                           loras={"a": lora}, lora_slots=SLOTS, buckets=BucketSpec(batch_sizes=(1,)))  # fmt: skip
    tol = fp8.card.parity.tolerance("fp8", "loop")
    for loras in ({"a": 0.8}, None):
        ours, reference = _latents(fp8, _request(loras)).cpu(), _latents(eager, _request(loras)).cpu()
        torch.testing.assert_close(ours, reference, atol=tol.atol, rtol=tol.rtol)
    layers = fp8.loop.components.transformer.config.num_layers
    changed = {"lora_index" in step.input_names: step.passes_changed["quantize"] for step in fp8.compiler.compiled_steps}
    assert changed == {True: 8 * layers, False: 8 * layers + 2 * layers}


def _placeholder_names(gm, step) -> dict[torch.fx.Node, str]:
    names = list(step_parameters(step))
    return dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], names))


def _calls(gm, targets) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def test_the_quantize_pass_swaps_the_base_linears_and_keeps_the_slot_factors_in_the_compute_dtype(tiny_card, lora):
    engine = Engine.from_card("tiny-wan", device="cpu", loras={"a": lora}, lora_slots=SLOTS, projection_cache_bytes=0)
    transformer = engine.loop.components.transformer
    quantized = apply_fp8_weights(transformer, tiny_card.quantization.fp8_exclude)
    assert not [name for name in quantized if "fvgraph_lora_slots" in name]  # slots hold no nn.Linear
    state = engine.start(_request({"a": 0.8}))
    plan = engine.loop.next(state)
    assert "lora_index" in plan.inputs
    step = engine.executor.steps[plan.kind]
    with CfgFusionPass().tracing(step):
        cap = capture_step(plan.kind, step, plan.inputs)
    graphs = {}
    for config in (PassConfig(), PassConfig(enabled=("quantize",))):
        ctx = PassContext(root=step, example_args=cap.example_args, num_params=cap.num_params)
        graphs[bool(config.enabled)] = (PassManager(config)(copy.deepcopy(cap.gm), ctx), ctx)
    (plain, _), (rewritten, ctx) = graphs[False], graphs[True]
    names = _placeholder_names(rewritten, step)
    layers = transformer.config.num_layers
    fp8 = _calls(rewritten, (FP8_LINEAR, FP8_LINEAR_PREQUANT))
    # every base linear of the step graph (8 per block) runs on its FP8 weight
    assert len(fp8) == 8 * layers == ctx.changed["quantize"] and not _calls(rewritten, (NORM_MODULATE_QUANT,))
    weights = [names[n.args[2] if n.target is FP8_LINEAR_PREQUANT else n.args[1]] for n in fp8]
    assert all(w.endswith(".fp8_weight") and w.removeprefix("transformer.").removesuffix(".fp8_weight") in quantized for w in weights)
    left = [names.get(n.args[1]) for n in _calls(rewritten, (F.linear,))]
    assert not [w for w in left if w and w.removeprefix("transformer.").removesuffix(".weight") in quantized]
    # no slot factor reaches an FP8 op; the low-rank GEMMs are those of the unquantized graph, in fp32
    slots = [node for node, name in names.items() if SLOT_BUFFERS in name]
    assert slots and not [n for n in _calls(rewritten, FP8_OPS) if set(n.all_input_nodes) & set(slots)]
    # (every linear the step calls has slots: the blocks' and the card's full-precision ones alike)
    low_rank = _calls(rewritten, LOW_RANK)
    assert len(low_rank) == len(_calls(plain, LOW_RANK)) == 2 * (len(fp8) + len(left)) and len(left) > 0
    assert {n.meta["example_value"].dtype for n in low_rank} == {torch.float32}
