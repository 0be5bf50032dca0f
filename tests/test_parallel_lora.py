"""LoRA adapters on parallel engines (CPU, gloo, 2 processes): a CFG-parallel and a Ulysses engine with
adapters, one built in and one loaded while serving, equal the single-process engine with the same
adapters (itself held to diffusers' load_lora_weights by test_lora_adapters.py), bit for bit at -O0
and within the card's fp32 loop tolerance at -O1;
loads and unloads reach every rank; a load refused on any rank leaves it loaded on none."""

import pytest
import torch

import fvgraph
from conftest import embeds
from fvgraph.adapters.lora_file import AdapterError, read_lora
from fvgraph.adapters.slots import LoraSlots
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.parallel.config import ParallelConfig
from fvgraph.parallel.rank_adapters import MESSAGE, RankAdapters
from fvgraph.runtime.buckets import BucketSpec
from lora_files import fresh_transformer, peft_lora

CARD = get_card("tiny-wan")
TOL = CARD.parity.tolerance("fp32", "loop")  # a compiled parallel engine's, as tests/test_parallel.py's
SHAPE = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 3}
SLOTS = LoraSlots(max_loras=3, max_lora_rank=8, max_loras_per_request=2)
MIX = [{"a": 0.8}, {"a": 0.5, "b": 1.0}, None]  # b is loaded while serving


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return {
        "a": peft_lora(d / "a", 1, ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"], rank=4, alpha=8.0),
        "b": peft_lora(d / "b", 2, ["attn1.to_q", "attn2.to_k", "attn2.to_v"], rank=4, alpha=4.0),
        "wide": peft_lora(d / "wide", 3, ["to_q"], rank=16, alpha=16.0),  # past max_lora_rank=8
    }


def _requests(mix=MIX):
    positive, negative = embeds(11, CARD)
    return [fvgraph.Request(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=5.0, seed=7 + i,
                            output_type="latent", loras=loras, **SHAPE) for i, loras in enumerate(mix)]  # fmt: skip


def _latents(engine, mix=MIX) -> list[torch.Tensor]:
    results = engine.generate(_requests(mix))
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.latents for r in results]


@pytest.fixture(scope="module")
def single_process(files):
    engine = Engine.from_card(CARD, device="cpu", loras={"a": files["a"], "b": files["b"]}, lora_slots=SLOTS,
                              projection_cache_bytes=0)  # fmt: skip
    latents = _latents(engine)
    base = _latents(Engine.from_card(CARD, device="cpu", projection_cache_bytes=0), [None] * len(MIX))
    assert (latents[1] - base[1]).abs().max() > 0.1  # the adapters move the result: a rank without them would show
    return latents


def _names(engine) -> dict[int, list[str]]:
    """The adapters each rank holds, rank 0's and every worker's."""
    workers = RankAdapters(engine.executor.group).loaded()
    return {0: [a["name"] for a in engine.loras()], **{rank: [a["name"] for a in held] for rank, held in workers.items()}}


@pytest.mark.parametrize("degrees", [{"cfg": 2}, {"ulysses": 2}], ids=["cfg2", "ulysses2"])
def test_a_parallel_engine_with_adapters_equals_the_single_process_engine(files, single_process, degrees):
    engine = Engine.from_card(CARD, device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS,
                              parallel=ParallelConfig(timeout_s=60, **degrees))  # fmt: skip
    try:
        assert engine.load_lora("b", files["b"])["slot"] == 1
        assert _names(engine) == {0: ["a", "b"], 1: ["a", "b"]}
        for ours, reference in zip(_latents(engine), single_process):
            assert torch.equal(ours, reference)
        engine.unload_lora("b")
        assert _names(engine) == {0: ["a"], 1: ["a"]}
        [gone] = engine.generate(_requests()[1:2])
        assert gone.status == "rejected" and "unknown lora 'b'" in gone.error
    finally:
        engine.close()


@pytest.mark.parametrize("degrees", [{"cfg": 2}, {"ulysses": 2}], ids=["cfg2", "ulysses2"])
def test_a_compiled_parallel_engine_with_adapters_equals_the_single_process_engine(files, single_process, degrees):
    """-O1 (aot_eager): each rank's compiled step takes the rows, at the widths the batches use."""
    engine = Engine.from_card(CARD, device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS, opt_level=1,
                              compile_config=CompileConfig(backend="aot_eager"), buckets=BucketSpec(batch_sizes=(2,)),
                              parallel=ParallelConfig(timeout_s=300, **degrees))  # fmt: skip
    try:
        engine.load_lora("b", files["b"])
        for ours, reference in zip(_latents(engine), single_process):
            torch.testing.assert_close(ours, reference, atol=TOL.atol, rtol=TOL.rtol)
        steps = engine.compiler.compiled_steps
        assert sorted("lora_index" in step.input_names for step in steps) == [False, True]  # no adapter row; two places
        # the plan's collectives in each graph: CFG's one all-gather; Ulysses' all-to-alls and its gather at proj_out
        collective = "_c10d_functional.all_gather_into_tensor" if "cfg" in degrees else "_c10d_functional.all_to_all_single"
        assert all(step.collectives.get(collective, 0) > 0 for step in steps)
        assert engine.counters.fallbacks == 0 and engine.counters.eager_steps == 0
    finally:
        engine.close()


def test_a_load_refused_on_any_rank_is_loaded_on_none(files):
    engine = Engine.from_card(CARD, device="cpu", loras={"a": files["a"]}, lora_slots=SLOTS, parallel=ParallelConfig(cfg=2))
    group = engine.executor.group
    try:
        # refused where rank 0 reads it, before any worker is asked
        with pytest.raises(AdapterError, match=r"lora_A.weight has rank 16 > max_lora_rank=8"):
            engine.load_lora("wide", files["wide"])
        assert _names(engine) == {0: ["a"], 1: ["a"]}
        # the workers write the high-noise (or only) expert's slots: another expert is refused before rank 0 reads
        with pytest.raises(AdapterError, match=r"a parallel engine loads adapters into 'transformer' only"):
            engine.load_lora("b", files["b"], expert="transformer_2")
        assert _names(engine) == {0: ["a"], 1: ["a"]}
        # refused by worker rank 1 alone: its slot 1 taken behind the engine's back, as a diverged rank's would be
        weights = read_lora(files["b"], CARD.pipeline_class, fresh_transformer())
        assert group.ask((MESSAGE, "load", "stray", weights, 1), "a test's stray load", [1]) == {1: ("ok", None)}
        with pytest.raises(AdapterError, match=r"lora 'b': worker rank 1 refused it \(AdapterError: lora 'b': slot 1 "
                                               r"\(rank 0's choice\) holds 'stray' on this rank\); no rank loaded it"):  # fmt: skip
            engine.load_lora("b", files["b"])
        assert _names(engine) == {0: ["a"], 1: ["a", "stray"]}
        # an unload refused by a worker (it lacks the adapter) leaves the adapter on rank 0, in use
        group.ask((MESSAGE, "unload", "stray"), "a test's cleanup", [1])
        assert engine.load_lora("b", files["b"])["slot"] == 1
        group.ask((MESSAGE, "unload", "b"), "a test's divergence", [1])
        with pytest.raises(AdapterError, match=r"lora 'b': worker rank 1 could not unload it \(AdapterError: unknown lora 'b'"):
            engine.unload_lora("b")
        assert _names(engine)[0] == ["a", "b"]
    finally:
        engine.close()
