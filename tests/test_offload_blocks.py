"""Block offload (`offload="blocks:N"`): results equal no offload bit for bit (-O0, and -O1 after
warmup with nothing compiled while serving), the ledger's copies per step and per group, groups that do
not divide the blocks, the two experts sharing the slots, the refusals, and on a GPU the CUDA graph's
replay and the device memory the weights hold."""

import json
from types import SimpleNamespace

import pytest
import torch

from fvgraph.card import ModelCard
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.runtime.offload import OffloadPolicy

SHAPE = {"height": 48, "width": 64, "num_frames": 5}
ONE_BUCKET = BucketSpec(batch_sizes=(1,))
# tiny-wan's block: 27 tensors, 52,096 bytes (fp32); its other weights, text encoder and VAE stay resident.
BLOCK_TENSORS, BLOCK_BYTES = 27, 52_096
NON_BLOCK_BYTES = 96_128  # tiny-wan's transformer without its blocks
RESIDENT = {"text_encoder": 115_968, "transformer": NON_BLOCK_BYTES + 2 * 3 * 8, "vae": 283_212}  # + the copy counter


# The decode runs one latent frame per step (fvgraph/loops/causal_decode.py): 5 frames are 2 latent frames.
DECODE = [("vae_decode_chunk", {})] * 2


def _request(steps: int = 3, **fields) -> Request:
    return Request(**{"prompt": "a red fox", "seed": 5, "guidance_scale": 4.0, "num_inference_steps": steps, **SHAPE, **fields})


def _copies(engine: Engine) -> list[tuple]:
    return [(s.kind, s.moved_in, s.tensors_in) for s in engine.residency.steps]


def _group(blocks: int, fetches: int) -> tuple[int, int]:
    """(bytes, tensors) that `fetches` copies of a group of `blocks` tiny-wan blocks move."""
    return fetches * blocks * BLOCK_BYTES, fetches * blocks * BLOCK_TENSORS


def _steps_rows(kinds_and_groups: list[tuple[str, dict]]) -> list[tuple]:
    return [(kind, {g: b for g, (b, _) in groups.items()}, {g: t for g, (_, t) in groups.items()})
            for kind, groups in kinds_and_groups]  # fmt: skip


def three_block_wan() -> ModelCard:
    """tiny-wan with 3 blocks: groups of 2 leave a last group of 1."""
    card = get_card("tiny-wan")
    spec = card.components["transformer"]
    components = {**card.components, "transformer": spec.model_copy(update={"config": {**spec.config, "num_layers": 3}})}
    return card.model_copy(update={"card_id": "tiny-wan-3-blocks", "components": components})


def test_a_tiny_wan_block_is_27_tensors_of_52096_bytes():
    plain = Engine.from_card("tiny-wan", device="cpu")
    block = plain.loop.components.transformer.blocks[0]
    tensors = [*block.parameters(), *block.buffers()]
    assert (len(tensors), sum(t.numel() * t.element_size() for t in tensors)) == (BLOCK_TENSORS, BLOCK_BYTES)


def test_groups_of_one_equal_no_offload_and_each_cfg_branch_copies_every_group():
    request = _request()
    [want] = Engine.from_card("tiny-wan", device="cpu").generate([request])
    offloaded = Engine.from_card("tiny-wan", device="cpu", offload="blocks:1")
    [got] = offloaded.generate([request])
    assert got.ok, got.error
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    # Eager CFG calls the transformer once per branch: each group is copied twice a step.
    denoise = {"transformer.blocks.0": _group(1, 2), "transformer.blocks.1": _group(1, 2)}
    assert _copies(offloaded) == _steps_rows([("text_encode", {}), *[("denoise_cfg", denoise)] * 3, *DECODE])
    slots = 2 * BLOCK_BYTES  # two slots of one block
    assert all(s.resident == {**RESIDENT, "block_slots": slots} for s in offloaded.residency.steps)
    assert offloaded.residency.planned_peak == sum(RESIDENT.values()) + slots
    assert dict(offloaded.residency.moves_in) == {"transformer.blocks.0": 6, "transformer.blocks.1": 6}


def test_groups_that_do_not_divide_the_blocks_equal_no_offload():
    card, request = three_block_wan(), _request(steps=2)
    [want] = Engine.from_card(card, device="cpu").generate([request])
    offloaded = Engine.from_card(card, device="cpu", offload="blocks:2")
    [got] = offloaded.generate([request])
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    denoise = {"transformer.blocks.0-1": _group(2, 2), "transformer.blocks.2": _group(1, 2)}
    assert _copies(offloaded) == _steps_rows([("text_encode", {}), *[("denoise_cfg", denoise)] * 2, *DECODE])
    assert offloaded.residency.steps[0].resident["block_slots"] == 2 * 2 * BLOCK_BYTES  # two slots of two blocks


def test_both_experts_stream_through_one_pair_of_slots_and_equal_no_offload():
    request = _request(steps=4, guidance_scale_2=2.0)
    [want] = Engine.from_card("tiny-wan2.2-a14b", device="cpu").generate([request])
    offloaded = Engine.from_card("tiny-wan2.2-a14b", device="cpu", offload="blocks:1")
    [got] = offloaded.generate([request])
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    c = offloaded.loop.components
    assert c.transformer.block_streaming.slots is c.transformer_2.block_streaming.slots
    kinds = [s.kind for s in offloaded.residency.steps]
    for step in offloaded.residency.steps:
        expert = {"denoise_cfg": "transformer", "denoise_cfg_2": "transformer_2"}.get(step.kind)
        assert set(step.moved_in) == (set() if expert is None else {f"{expert}.blocks.0", f"{expert}.blocks.1"})
        assert step.resident["block_slots"] == 2 * BLOCK_BYTES
    assert {"denoise_cfg", "denoise_cfg_2"} <= set(kinds)


def test_compiled_blocks_offload_equals_compiled_without_and_serves_without_recompiling():
    request = _request()
    config = dict(device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"), buckets=ONE_BUCKET)
    plain = Engine.from_card("tiny-wan", **config)
    offloaded = Engine.from_card("tiny-wan", offload="blocks:1", **config)
    plain.warmup([request])
    offloaded.warmup([request])  # then fail_on_recompile
    offloaded.residency.clear()
    with offloaded.counters.expect(compiles=0, fallbacks=0, compiled_steps=3):
        [got] = offloaded.generate([request])
    [want] = plain.generate([request])
    assert got.ok, got.error
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    # Fused CFG runs the blocks once a step; the request's first step also runs its prologue, whose
    # hoisted cross-attention K/V read each group once more (copies counted by the copy op itself).
    first = {"transformer.blocks.0": _group(1, 2), "transformer.blocks.1": _group(1, 2)}
    later = {"transformer.blocks.0": _group(1, 1), "transformer.blocks.1": _group(1, 1)}
    assert _copies(offloaded) == _steps_rows(
        [("text_encode", {}), ("denoise_cfg", first), ("denoise_cfg", later), ("denoise_cfg", later), *DECODE]
    )


def test_update_weights_writes_the_host_copies_that_the_next_step_streams():
    request = _request(steps=2)
    plain = Engine.from_card("tiny-wan", device="cpu")
    offloaded = Engine.from_card("tiny-wan", device="cpu", offload="blocks:1")
    noise = torch.Generator().manual_seed(0)
    weights = {k: v + 0.01 * torch.randn(v.shape, generator=noise)
               for k, v in plain.loop.components.transformer.state_dict().items()}  # fmt: skip
    [before] = plain.generate([request])
    plain.update_weights(weights, "v2")
    offloaded.update_weights(weights, "v2")
    [want], [got] = plain.generate([request]), offloaded.generate([request])
    assert not torch.equal(before.latents, want.latents)  # the new weights change the result
    assert torch.equal(want.latents, got.latents)


@pytest.mark.parametrize("value", ["blocks:0", "blocks:-1", "components,blocks:1", "blocks:1.5"])
def test_bad_block_counts_are_refused_naming_offload(value):
    with pytest.raises(ValueError, match=r"offload=.*must be None, \"components\", or \"blocks:N\" with N a whole number >= 1"):
        OffloadPolicy.parse(value)


def test_groups_larger_than_the_transformer_are_refused_naming_the_card():
    with pytest.raises(ValueError, match=r"offload='blocks:3': N must be at most the number of transformer blocks \(2 in card 'tiny-wan'"):
        Engine.from_card("tiny-wan", device="cpu", offload="blocks:3")


def test_a_transformer_without_blocks_is_refused_naming_the_card():
    with pytest.raises(ValueError, match=r"offload='blocks:1': card 'tiny-flux'.s transformer .* has no `blocks` list"):
        Engine.from_card("tiny-flux", device="cpu", offload="blocks:1")


def test_the_default_budget_on_a_gpu_takes_off_no_weight_block_offload_already_holds(monkeypatch):
    """On a GPU the budget is a share of the free device memory, read with block offload's resident
    weights and slots already there: taking `planned_peak` off again would count them twice. (This
    machine has no GPU: the engine's device and the free memory are given; the arithmetic is the code's.)"""
    from fvgraph.serving import memory_reservation

    offloaded = Engine.from_card("tiny-wan", device="cpu", offload="blocks:1")
    assert offloaded.residency.held_from_build == offloaded.residency.planned_peak > 0
    free = 8 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    on_gpu = SimpleNamespace(loop=SimpleNamespace(components=SimpleNamespace(device=torch.device("cuda", 0))),
                             residency=offloaded.residency)  # fmt: skip
    assert memory_reservation.default_budget(on_gpu) == int(free * memory_reservation.CUDA_BUDGET_SHARE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_equal_no_offload_and_the_device_holds_two_groups():
    """Three blocks in groups of one: slot 0 holds group 0, then group 2, in every replay (with two
    blocks each slot always holds the same group, and a copy landing out of order changes nothing)."""
    card, request = three_block_wan(), _request()
    config = dict(device="cuda", opt_level=2, buckets=ONE_BUCKET)
    plain = Engine.from_card(card, **config)
    offloaded = Engine.from_card(card, offload="blocks:1", **config)
    plain.warmup([request])
    offloaded.warmup([request])
    offloaded.residency.clear()
    with offloaded.counters.expect(compiles=0, captures=0, fallbacks=0):
        [got] = offloaded.generate([request])
    [want] = plain.generate([request])
    assert got.ok, got.error
    assert torch.equal(want.latents, got.latents)
    assert offloaded.counters.replays > 0
    # The copy op counts on the device, so a replayed graph counts its copies as -O1 does (the test above).
    first = {f"transformer.blocks.{g}": _group(1, 2) for g in range(3)}
    later = {f"transformer.blocks.{g}": _group(1, 1) for g in range(3)}
    assert _copies(offloaded) == _steps_rows(
        [("text_encode", {}), ("denoise_cfg", first), ("denoise_cfg", later), ("denoise_cfg", later), *DECODE]
    )
    transformer = offloaded.loop.components.transformer
    streamed = transformer.block_streaming
    on_device = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in (*transformer.parameters(), *transformer.buffers()) if t.is_cuda}  # fmt: skip
    blocks = [t for block in transformer.blocks for t in (*block.parameters(), *block.buffers())]
    assert all(not t.is_cuda and t.is_pinned() for t in blocks)
    assert sum(on_device.values()) <= streamed.slots.nbytes + NON_BLOCK_BYTES + streamed.copies.nbytes
    assert streamed.slots.nbytes == 2 * BLOCK_BYTES


def wide_block_wan() -> ModelCard:
    """tiny-wan with three blocks of about 100 MB (fp32) and a few dozen tokens: a group's copy takes
    far longer than its kernels, so the next group's copy is still running while they run."""
    card = three_block_wan()
    spec = card.components["transformer"]
    wide = {**spec.config, "num_attention_heads": 8, "attention_head_dim": 128, "ffn_dim": 8192}
    return card.model_copy(update={"card_id": "tiny-wan-wide-blocks",
                                   "components": {**card.components, "transformer": spec.model_copy(update={"config": wide})}})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", [0, 2])
def test_a_groups_copy_runs_on_the_copy_stream_while_kernels_run(level, tmp_path):
    """The profiler's trace of a request (-O2: replayed CUDA graphs): the copies of the blocks' largest
    tensors run on a stream no kernel runs on, and some of them while a kernel runs (the next group's
    copy under this group's kernels). Both follow from the streams' order, not from speed: group g+1's
    copy and group g's kernels each wait only for group g's copy."""
    card, request = wide_block_wan(), _request(steps=2)
    engine = Engine.from_card(card, device="cuda", opt_level=level, buckets=ONE_BUCKET, offload="blocks:1")
    engine.warmup([request])
    engine.residency.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        [result] = engine.generate([request])
        torch.cuda.synchronize()
    assert result.ok, result.error
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    sizes = [t.numel() * t.element_size() for t in engine.loop.components.transformer.blocks[0].parameters()]
    largest = max(sizes)  # the feed-forward weights, 32 MiB each: nothing else the request copies is that large
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and e.get("args", {}).get("bytes") == largest]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    fetches = sum(engine.residency.moves_in.values())  # the group fetches the copy op counted
    assert fetches > 0 and len(copies) == sizes.count(largest) * fetches, (fetches, len(copies))
    if level == 0:  # eager: the trace names each kernel's own stream (a replayed graph's may carry its launch stream)
        assert {e["args"]["stream"] for e in copies}.isdisjoint(e["args"]["stream"] for e in kernels)
    overlapping = [c for c in copies if any(k["ts"] < c["ts"] + c["dur"] and c["ts"] < k["ts"] + k["dur"] for k in kernels)]
    assert overlapping, f"no block copy ran while a kernel ran: {len(copies)} copies, {len(kernels)} kernels"
