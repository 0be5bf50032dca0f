"""What offload holds in host memory is never placed on the device while the engine is built.

The meta device stands in for the accelerator: a tensor on it is one the build put on the device
(meta holds no data, so nothing could be computed there, and building computes nothing on the
device). Without offload every component's tensor is there, which is how these tests can fail; with
`offload="components"` none is (each comes to the device at its first step, counted in the ledger:
tests/test_offload.py); with `offload="blocks:N"` only the transformers' blocks stay in host memory.
"""

import pytest
import torch

import fvgraph.engine.builder as builder
import fvgraph.engine.parts as parts
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.parallel.config import ParallelConfig
from fvgraph.request import Request
from fvgraph.runtime.pinned_host import pin_in_place

CARD = "tiny-wan2.2-a14b"  # two experts, a text encoder, a VAE


def _devices(engine: Engine) -> dict[tuple[str, bool], set[str]]:
    """(component, whether the tensor is a block's) -> the device types its tensors are on."""
    found: dict[tuple[str, bool], set[str]] = {}
    for name, module in engine.loop.components.modules().items():
        if isinstance(module, torch.nn.Module):
            for key, tensor in (*module.named_parameters(), *module.named_buffers()):
                found.setdefault((name, key.startswith("blocks.")), set()).add(tensor.device.type)
    return found


def _step_own_devices(engine: Engine) -> set[str]:
    """The device types of the step modules' own tensors (the VAE's latent statistics, not a component's)."""
    c = engine.loop.components
    components = {id(t) for m in c.modules().values() if isinstance(m, torch.nn.Module) for t in (*m.parameters(), *m.buffers())}
    steps = engine.executor.steps.values()
    return {t.device.type for s in steps for t in (*s.parameters(), *s.buffers()) if id(t) not in components}


def test_without_offload_the_build_places_every_component_on_the_device():
    engine = Engine.from_card(CARD, device="meta")
    devices = _devices(engine)
    assert len(devices) == 6 and all(d == {"meta"} for d in devices.values()), devices
    assert _step_own_devices(engine) == {"meta"}


def test_component_offload_builds_with_every_component_in_host_memory():
    engine = Engine.from_card(CARD, device="meta", offload="components")
    devices = _devices(engine)
    assert {name for name, _ in devices} == {"transformer", "transformer_2", "text_encoder", "vae"}
    assert all(d == {"cpu"} for d in devices.values()), devices
    assert _step_own_devices(engine) == {"meta"}  # what the steps hold themselves goes to the device
    assert engine.residency.moves_in == {} and engine.executor.residency.resident == {}


def test_block_offload_builds_with_only_the_blocks_in_host_memory():
    engine = Engine.from_card(CARD, device="meta", offload="blocks:1")
    devices = _devices(engine)
    for expert in ("transformer", "transformer_2"):
        assert devices[(expert, True)] == {"cpu"}  # the blocks: streamed a group at a time into the slots
        assert devices[(expert, False)] == {"meta"}  # embeddings, output layers, the slots, the copy counter
    assert devices[("text_encoder", False)] == devices[("vae", False)] == {"meta"}
    slots = engine.loop.components.transformer.block_streaming.slots
    assert {t.device.type for t in slots.buffers()} == {"meta"}
    assert slots is engine.loop.components.transformer_2.block_streaming.slots


def test_offload_on_a_parallel_engine_is_refused_before_loading_or_starting_workers(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("loaded or started before the refusal")

    monkeypatch.setattr(parts, "load_components", must_not_run)
    monkeypatch.setattr(builder.WorkerGroup, "spawn", must_not_run)
    with pytest.raises(ValueError, match="offload does not run on a parallel engine"):
        Engine.from_card("tiny-wan", device="cpu", offload="components", parallel=ParallelConfig(cfg=2))


def test_host_copies_are_packed_into_chunks_and_each_tensor_points_at_its_own():
    """On CUDA offload pins its host copies so (pinned allocations round up to a power of two: packed,
    only a component's last chunk is); packing is the same without pinning, which runs here."""
    weights = [torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(3, 7).to(torch.bfloat16)),
               torch.nn.Parameter(torch.zeros(0)), torch.arange(600, dtype=torch.int64), torch.randn(5, 4).t()]  # fmt: skip
    values, ids = [w.detach().clone() for w in weights], [id(w) for w in weights]
    copies = pin_in_place(weights, pin=False, chunk_bytes=1024)
    assert [id(w) for w in weights] == ids  # the same parameters, pointed at their copies
    for weight, copy, value in zip(weights, copies, values):
        assert weight.data_ptr() == copy.data_ptr() and weight.dtype == value.dtype and torch.equal(weight, value)
    first = weights[0].untyped_storage().data_ptr()
    # 400 and 42 bytes share a chunk at 512-byte steps; 4,800 bytes (over the chunk) stand alone, in 5,120;
    # the last 80 bytes go to a chunk of their own, no larger than they need.
    assert weights[1].data_ptr() - first == 512 and weights[1].untyped_storage().data_ptr() == first
    assert weights[3].untyped_storage().data_ptr() != first and weights[3].untyped_storage().nbytes() == 5_120
    assert weights[4].untyped_storage().nbytes() == 512 and weights[4].is_contiguous()


def test_fp8_weights_are_made_before_offload_and_move_with_their_linears():
    """-O3's FP8 buffers are made at the build; offload must hold them in host memory and bring them to
    the device with their weights (made after offload had listed what it moves, they were never moved:
    on a GPU the step would read host tensors)."""
    engine = Engine.from_card("tiny-wan", device="cpu", offload="components", opt_level=3,
                              compile_config=CompileConfig(backend="aot_eager"))  # fmt: skip
    dit = engine.loop.components.transformer
    fp8 = [t for name, t in dit.named_buffers() if name.endswith("fp8_weight")]
    assert fp8, "-O3 quantized no linear of tiny-wan"
    engine.residency.clear()
    [result] = engine.generate([Request(prompt="a red fox", seed=5, num_inference_steps=2, height=48, width=64, num_frames=5)])
    assert result.ok, result.error
    every = {id(t): t for t in (*dit.parameters(), *dit.buffers())}.values()
    assert engine.residency.bytes_in["transformer"] == sum(t.numel() * t.element_size() for t in every)
