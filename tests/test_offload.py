"""Component offload: results equal no offload bit for bit (-O0, and -O1 after warmup with nothing
recompiled), the residency ledger's counts per step, a two-expert request moving each expert once,
the resident expert's steps preferred with requests on both sides of the boundary, and the errors."""

import pytest
import torch

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.runtime.component_residency import ComponentResidency
from fvgraph.runtime.offload import OffloadPolicy, ResidencyLedger

SHAPE = {"height": 48, "width": 64, "num_frames": 5}
ONE_BUCKET = BucketSpec(batch_sizes=(1,))  # -O1 batches of one: the same graphs with and without offload


def _bytes(engine: Engine) -> dict[str, int]:
    c = engine.loop.components
    return {name: sum(t.numel() * t.element_size() for t in {id(t): t for t in (*m.parameters(), *m.buffers())}.values())
            for name, m in c.modules().items() if isinstance(m, torch.nn.Module)}  # fmt: skip


def _ledger_rows(engine: Engine) -> list[tuple]:
    return [(s.kind, s.resident, s.moved_in, s.moved_out) for s in engine.residency.steps]


def _request(steps: int = 3, **fields) -> Request:
    return Request(**{"prompt": "a red fox", "seed": 5, "guidance_scale": 4.0, "num_inference_steps": steps, **SHAPE, **fields})


@pytest.fixture(scope="module")
def wan_pair():
    return Engine.from_card("tiny-wan", device="cpu"), Engine.from_card("tiny-wan", device="cpu", offload="components")


@pytest.fixture(scope="module")
def a14b_pair():
    return (Engine.from_card("tiny-wan2.2-a14b", device="cpu"),
            Engine.from_card("tiny-wan2.2-a14b", device="cpu", offload="components"))  # fmt: skip


def test_tiny_wan_request_equals_no_offload_and_the_ledger_counts_each_step(wan_pair):
    plain, offloaded = wan_pair
    offloaded.residency.clear()
    [want], [got] = plain.generate([_request()]), offloaded.generate([_request()])
    assert got.ok, got.error
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    b = _bytes(offloaded)
    te, dit, vae = b["text_encoder"], b["transformer"], b["vae"]
    assert _ledger_rows(offloaded) == [
        ("text_encode", {"text_encoder": te}, {"text_encoder": te}, {}),
        ("denoise_cfg", {"transformer": dit}, {"transformer": dit}, {"text_encoder": te}),
        ("denoise_cfg", {"transformer": dit}, {}, {}),
        ("denoise_cfg", {"transformer": dit}, {}, {}),
        # The decode, one latent frame per step (fvgraph/loops/causal_decode.py): the VAE comes in once.
        ("vae_decode_chunk", {"vae": vae}, {"vae": vae}, {"transformer": dit}),
        ("vae_decode_chunk", {"vae": vae}, {}, {}),
    ]
    assert offloaded.residency.peak_resident == max(te, dit, vae)
    assert dict(offloaded.residency.moves_in) == {"text_encoder": 1, "transformer": 1, "vae": 1}
    assert not offloaded.residency.written_back  # nothing changed the weights on the device


def test_between_requests_the_weights_wait_in_host_memory(wan_pair):
    _, offloaded = wan_pair
    offloaded.generate([_request(steps=1)])
    components = offloaded.loop.components
    host = offloaded.executor.residency._host
    for name in ("text_encoder", "transformer"):
        module = getattr(components, name)
        assert all(p.data_ptr() == h.data_ptr() for p, h in zip(module.parameters(), host[name]))
    assert set(offloaded.executor.residency.resident) == {"vae"}  # the last step's component stays until another needs the device


def test_two_expert_request_moves_each_expert_once_and_equals_no_offload(a14b_pair):
    plain, offloaded = a14b_pair
    offloaded.residency.clear()
    request = _request(steps=6, guidance_scale_2=2.0)
    [want], [got] = plain.generate([request]), offloaded.generate([request])
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    ledger = offloaded.residency
    kinds = [s.kind for s in ledger.steps]
    assert kinds[0] == "text_encode" and kinds[-1] == "vae_decode_chunk" and {"denoise_cfg", "denoise_cfg_2"} <= set(kinds)
    assert dict(ledger.moves_in) == {"text_encoder": 1, "transformer": 1, "transformer_2": 1, "vae": 1}
    assert dict(ledger.moves_out) == {"text_encoder": 1, "transformer": 1, "transformer_2": 1}
    b = _bytes(offloaded)
    assert b["transformer"] == b["transformer_2"]
    for step in ledger.steps:  # one expert on the device at a time, nothing else beside it
        assert len(step.resident) == 1
    first_low = kinds.index("denoise_cfg_2")
    boundary = ledger.steps[first_low]
    assert boundary.moved_in == {"transformer_2": b["transformer_2"]} and boundary.moved_out == {"transformer": b["transformer"]}


def test_flux_text_encode_brings_both_text_encoders_and_equals_no_offload():
    """The components a kind reads are found in its step module: FLUX's text_encode reads CLIP and T5."""
    request = Request(prompt="a fox", seed=1, num_inference_steps=2, height=64, width=64)
    [want] = Engine.from_card("tiny-flux", device="cpu").generate([request])
    offloaded = Engine.from_card("tiny-flux", device="cpu", offload="components")
    [got] = offloaded.generate([request])
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    b = _bytes(offloaded)
    assert [(s.kind, set(s.resident), set(s.moved_in), set(s.moved_out)) for s in offloaded.residency.steps] == [
        ("text_encode", {"text_encoder", "text_encoder_2"}, {"text_encoder", "text_encoder_2"}, set()),
        ("denoise", {"transformer"}, {"transformer"}, {"text_encoder", "text_encoder_2"}),
        ("denoise", {"transformer"}, set(), set()),
        ("vae_decode", {"vae"}, {"vae"}, {"transformer"}),
    ]
    assert offloaded.residency.steps[0].resident == {"text_encoder": b["text_encoder"], "text_encoder_2": b["text_encoder_2"]}


def test_the_experts_share_one_device_slot(a14b_pair):
    """The expert taking over is copied into the storage the other used: both experts' steps read the
    same addresses (what CUDA graphs of both kinds need)."""
    _, offloaded = a14b_pair
    residency = offloaded.executor.residency
    c = offloaded.loop.components
    residency.before("denoise_cfg")
    first = [p.data_ptr() for p in c.transformer.parameters()]
    residency.before("denoise_cfg_2")
    assert [p.data_ptr() for p in c.transformer_2.parameters()] == first
    assert all(p.data_ptr() != a for p, a in zip(c.transformer.parameters(), first))  # back in host memory


def test_requests_on_both_sides_of_the_boundary_do_not_thrash_the_experts(a14b_pair):
    """Three requests started a few ticks apart: each tick runs the resident expert's steps, the other
    expert's wait (at most PATIENCE ticks); every result equals the request run alone."""
    plain, offloaded = a14b_pair
    requests = [_request(steps=6, seed=s, request_id=f"r{s}", guidance_scale_2=2.0) for s in range(3)]
    alone = [plain.generate([r])[0] for r in requests]
    offloaded.residency.clear()
    for request in requests:  # staggered: each arrives two ticks after the last
        offloaded.submit(request)
        offloaded.tick()
        offloaded.tick()
    results = {}
    while offloaded.has_work():
        results.update((r.request_id, r) for r in offloaded.tick())
    for want in alone:
        assert torch.equal(results[want.request_id].latents, want.latents)
    # Each component in twice for the three requests; every tick running both experts' groups would
    # move an expert in 11 times here.
    assert dict(offloaded.residency.moves_in) == {"text_encoder": 2, "transformer": 2, "transformer_2": 2, "vae": 2}


def test_compiled_offload_equals_compiled_without_and_serves_without_recompiling():
    request = _request(steps=4, guidance_scale_2=2.0)
    config = dict(device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"), buckets=ONE_BUCKET)
    plain = Engine.from_card("tiny-wan2.2-a14b", **config)
    offloaded = Engine.from_card("tiny-wan2.2-a14b", offload="components", **config)
    plain.warmup([request])
    offloaded.warmup([request])  # then fail_on_recompile
    offloaded.residency.clear()
    with offloaded.counters.expect(compiles=0, fallbacks=0, compiled_steps=4):
        [got] = offloaded.generate([request])
    [want] = plain.generate([request])
    assert got.ok, got.error
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    assert dict(offloaded.residency.moves_in) == {"text_encoder": 1, "transformer": 1, "transformer_2": 1, "vae": 1}
    eager = Engine.from_card("tiny-wan2.2-a14b", device="cpu").generate([request])[0]
    assert torch.allclose(eager.latents, got.latents, atol=1e-4)


def test_a_weight_changed_on_the_device_is_copied_back_before_it_leaves():
    ledger = ResidencyLedger()
    encoder, decoder = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    steps = {"encode": torch.nn.Sequential(encoder), "decode": torch.nn.Sequential(decoder)}
    residency = ComponentResidency({"encoder": encoder, "decoder": decoder}, steps, torch.device("cpu"), ledger)
    residency.before("encode")
    with torch.no_grad():
        encoder.weight.copy_(torch.full((4, 4), 3.0))  # as update_weights writes a resident weight
    residency.before("decode")
    assert ledger.written_back["encoder"] == 4 * 4 * 4 and not ledger.written_back["decoder"]
    assert torch.equal(encoder.weight, torch.full((4, 4), 3.0))  # now read from host memory
    residency.before("encode")
    assert torch.equal(encoder.weight, torch.full((4, 4), 3.0))


@pytest.mark.parametrize("value", ["component", "blocks:0", "blocks:x", "blocks", 3])
def test_offload_values_are_checked_naming_offload_and_the_rule(value):
    with pytest.raises(ValueError, match=r"offload=.*must be None, \"components\", or \"blocks:N\""):
        OffloadPolicy.parse(value)


def test_blocks_offload_parses():  # built and tested in tests/test_offload_blocks.py
    assert OffloadPolicy.parse("blocks:2") == OffloadPolicy("blocks", 2)


def test_generate_offloads_with_the_flag_and_names_it_in_errors(tmp_path):
    from typer.testing import CliRunner

    from fvgraph.cli import app

    out = tmp_path / "fox.gif"
    args = ["generate", "tiny-wan", "-p", "a fox", "--steps", "1", "--frames", "5", "-O0", "-o", str(out)]
    done = CliRunner().invoke(app, [*args, "--offload", "components"])
    assert done.exit_code == 0, done.output
    assert out.exists()
    refused = CliRunner().invoke(app, [*args, "--offload", "everything"])
    assert refused.exit_code == 2 and "--offload='everything': offload must be None" in refused.output, refused.output


def test_the_next_group_of_the_tick_is_prefetched_while_this_one_runs():
    """On a CPU the prefetch copies at once, right after the running group was launched: both are
    resident then, and the next group finds its component in place (its move counted for it)."""
    ledger = ResidencyLedger()
    encoder, decoder = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
    steps = {"encode": torch.nn.Sequential(encoder), "decode": torch.nn.Sequential(decoder)}
    residency = ComponentResidency({"encoder": encoder, "decoder": decoder}, steps, torch.device("cpu"), ledger)
    residency.upcoming = ["encode", "decode"]  # as the scheduler's arrangement of a tick hands it over
    with residency.around("encode"):
        assert set(residency.resident) == {"encoder"}
    assert set(residency.resident) == {"encoder", "decoder"}  # prefetched once "encode" was launched
    with residency.around("decode"):
        pass
    assert [(s.kind, s.moved_in, s.moved_out) for s in ledger.steps] == [
        ("encode", {"encoder": 80}, {}), ("decode", {"decoder": 160}, {"encoder": 80})]  # weight + bias, fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_with_one_expert_on_the_device_and_the_build_places_no_component():
    """-O2 on CUDA: the experts share one fixed slot, so both experts' graphs read its addresses and
    replay; the result equals no offload. The build allocates less on the device, at its peak, than
    the smallest component (what offload holds stays in host memory, pinned)."""
    request = _request(steps=4, guidance_scale_2=2.0)
    config = dict(device="cuda", opt_level=2, buckets=ONE_BUCKET)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    offloaded = Engine.from_card("tiny-wan2.2-a14b", offload="components", **config)
    built_peak = torch.cuda.max_memory_allocated() - before
    b = _bytes(offloaded)
    assert built_peak < min(b.values()), (built_peak, b)
    assert all(h.is_pinned() for hosts in offloaded.executor.residency._host.values() for h in hosts)
    plain = Engine.from_card("tiny-wan2.2-a14b", **config)
    plain.warmup([request])
    offloaded.warmup([request])
    offloaded.residency.clear()
    with offloaded.counters.expect(compiles=0, captures=0, fallbacks=0):
        [got] = offloaded.generate([request])
    [want] = plain.generate([request])
    assert got.ok, got.error
    assert torch.equal(want.latents, got.latents) and (want.frames == got.frames).all()
    assert offloaded.counters.replays > 0
    assert dict(offloaded.residency.moves_in) == {"text_encoder": 1, "transformer": 1, "transformer_2": 1, "vae": 1}
    for step in offloaded.residency.steps:  # the expert slot stays while the text encoder or the VAE runs
        assert len({"transformer", "transformer_2"} & set(step.resident)) <= 1
