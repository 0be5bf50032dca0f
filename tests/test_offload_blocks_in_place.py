"""Block offload's copies in a compiled step (fvgraph/compile/compiled_block_copies.py), on a four-block
tiny-wan with `offload="blocks:1"` (groups 2 and 3 are each the second fetch into a slot): at
aot_eager each compiled step allocates no more than the same step without offload, within one 8 KiB
allocation of run-to-run noise (peak of the CPU allocator's live bytes, from the profiler's allocation
events); under inductor the results equal no offload bit for bit and every copy writes the slots
themselves; a step loaded from the capture cache is written in place too. On toy streams of four
groups: the rewrite keeps a copy functional (a clone) where a later node reads the value it would
overwrite, and inductor reads each group's weights before the next fetch into its slot."""

import contextlib
import re

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.compile_fx import compile_fx
from torch._inductor.fx_passes.post_grad import reorder_for_locality
from torch._inductor.utils import fresh_cache, run_and_get_code
from torch.profiler import ProfilerActivity, profile

from fvgraph.card import ModelCard
from fvgraph.cards import get_card
from fvgraph.compile.compiled_block_copies import aot_eager_in_place, inductor_config, write_block_copies_in_place
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec

REQUEST = Request(prompt="a red fox", seed=5, guidance_scale=4.0, num_inference_steps=3, height=48, width=64, num_frames=5)


def four_block_wan() -> ModelCard:
    """tiny-wan with 4 blocks: with groups of one, groups 2 and 3 are each the second fetch into a slot."""
    card = get_card("tiny-wan")
    spec = card.components["transformer"]
    components = {**card.components, "transformer": spec.model_copy(update={"config": {**spec.config, "num_layers": 4}})}
    return card.model_copy(update={"card_id": "tiny-wan-4-blocks", "components": components})


def _peak_bytes(prof) -> int:
    """The most bytes the CPU allocator held at once beyond what it held when profiling began."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


# The first step's peak of one engine varies by one 8 KiB allocation between runs (123,136 or 114,944
# bytes, with or without offload); the slots' clones this guards against cost 118,088.
ALLOCATOR_NOISE = 8192


def _no_more_than(peaks: list[tuple[str, int]], reference: list[tuple[str, int]]) -> bool:
    return all(0 < peak <= ref + ALLOCATOR_NOISE for (_, peak), (_, ref) in zip(peaks, reference, strict=True))


def _step_peaks(engine: Engine) -> list[tuple[str, int]]:
    """(kind, peak bytes) of every compiled group the engine runs from now on."""
    runner, peaks = engine.executor.runner, []
    run = runner.run

    def profiled(step, plans, *args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = run(step, plans, *args, **kwargs)
        peaks.append((plans[0].kind, _peak_bytes(prof)))
        return out

    runner.run = profiled
    return peaks


def _run(backend: str, offload: str | None, fresh: bool = False) -> tuple[torch.Tensor, list, str]:
    """A warmed four-block tiny-wan engine's request: its latents, each compiled group's peak, and the
    code inductor generated at warmup (from a fresh cache when `fresh`)."""
    config = dict(device="cpu", opt_level=1, compile_config=CompileConfig(backend=backend), buckets=BucketSpec(batch_sizes=(1,)))
    engine = Engine.from_card(four_block_wan(), offload=offload, **config)
    with fresh_cache() if fresh else contextlib.nullcontext():
        _, code = run_and_get_code(engine.warmup, [REQUEST])
    peaks = _step_peaks(engine)
    with engine.counters.expect(compiles=0):
        [result] = engine.generate([REQUEST])
    return result.latents, peaks, "".join(code)


def test_a_compiled_step_with_streamed_blocks_at_aot_eager_allocates_no_more_than_without():
    want, plain, _ = _run("aot_eager", None)
    got, streamed, _ = _run("aot_eager", "blocks:1")
    assert torch.equal(want, got)
    assert [kind for kind, _ in streamed] == ["denoise_cfg"] * 3
    # Functionalized, the copies held clones of the slots: 241,224 bytes against 123,136 a step.
    assert _no_more_than(streamed, plain), (streamed, plain)


def test_a_compiled_step_with_streamed_blocks_under_inductor_equals_no_offload_and_copies_into_the_slots():
    want, _, _ = _run("inductor", None)
    got, _, code = _run("inductor", "blocks:1", fresh=True)
    assert torch.equal(want, got)  # before the copies' lowering: up to 0.26 apart, of latents of RMS 1.1
    # Every fetch and wait (prologue and step) is called on the step's arguments, the slots themselves;
    # before, later fetches wrote buffers inductor allocated (`reinterpret_tensor(buf10, ...)`).
    calls = re.findall(r"fvgraph\.(?:fetch|wait)_group\.default\(\[([^\]]*)\]", code)
    assert len(calls) == 2 * 8
    assert all(re.fullmatch(r"arg\d+_1", name.strip()) for call in calls for name in call.split(","))


D, GROUPS = 64, 4


class ToyStream(nn.Module):
    """Four groups of one weight each, streamed through two slots as block_streaming orders it."""

    def __init__(self):
        super().__init__()
        for g in range(GROUPS):
            self.register_buffer(f"host{g}", torch.randn(D, D, generator=torch.Generator().manual_seed(g)))
        self.register_buffer("slot0", torch.zeros(D, D))
        self.register_buffer("slot1", torch.zeros(D, D))
        self.register_buffer("copies", torch.zeros(GROUPS, 3, dtype=torch.int64))

    def forward(self, x):
        slots = [[self.slot0], [self.slot1]]
        torch.ops.fvgraph.fetch_group(slots[0], [self.host0], self.copies, 0)
        for g in range(GROUPS):
            torch.ops.fvgraph.wait_group(slots[g % 2])
            if g + 1 < GROUPS:
                torch.ops.fvgraph.fetch_group(slots[(g + 1) % 2], [getattr(self, f"host{g + 1}")], self.copies, g + 1)
            x = self.read(x, slots[g % 2][0])
        return x

    def read(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)


class GatedStream(ToyStream):
    """Each group's read is pointwise (as a block's gated residual add): inductor fuses it with the
    next group's."""

    def read(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * weight[0] + 1


def _compiled_toy(reorder: bool):
    counts = []

    def forward_compiler(gm, example_inputs):
        if reorder:
            reorder_for_locality(gm.graph)  # inductor's: moves each group's read next to its consumer
        counts.append(write_block_copies_in_place(gm))
        return boxed_nop(gm, example_inputs)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler, keep_inference_input_mutations=True)

    return backend, counts


@pytest.mark.parametrize("reorder, expected", [(False, (8, 0)), (True, (6, 2))])
def test_a_copy_whose_slot_is_read_after_it_writes_a_clone_and_results_hold(reorder, expected):
    """In program order all 8 calls (4 fetches, 4 waits) write in place; once the reads of groups 0
    and 1 are moved past the fetches of groups 2 and 3 into their slots, those two fetches clone."""
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(9))
    eager = ToyStream()
    with torch.no_grad():
        want = eager(x)
    toy = ToyStream()
    backend, counts = _compiled_toy(reorder)
    with torch.no_grad():
        got = torch.compile(toy, backend=backend, fullgraph=True)(x)
    assert counts == [expected]
    assert torch.equal(want, got)
    assert torch.equal(toy.slot0, toy.host2) and torch.equal(toy.slot1, toy.host3)  # the program's last copies
    assert toy.copies[:, 0].tolist() == [1] * GROUPS


def test_aot_eager_in_place_writes_the_slots_and_counts_each_copy_once():
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(9))
    toy = ToyStream()
    slots = (toy.slot0.data_ptr(), toy.slot1.data_ptr())
    compiled = torch.compile(toy, backend=aot_eager_in_place, fullgraph=True)
    with torch.no_grad():
        want, got = ToyStream()(x), compiled(x)
        got_again = compiled(x)
    assert torch.equal(want, got) and torch.equal(want, got_again)
    assert (toy.slot0.data_ptr(), toy.slot1.data_ptr()) == slots
    assert toy.copies[:, 0].tolist() == [2] * GROUPS and toy.copies[:, 2].tolist() == [2 * D * D * 4] * GROUPS


def test_inductor_reads_each_group_before_the_next_fetch_into_its_slot_and_writes_in_place():
    """Without the copies' lowering, inductor (torch 2.13) computed groups 0 and 1's pointwise reads in
    one kernel after groups 2 and 3 were fetched into their slots (so with groups 2 and 3's weights),
    and with its own reordering on, fetches 2 and 3 wrote clones of their slots."""
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = GatedStream()(x)
        toy = GatedStream()

        def backend(gm, example_inputs):  # inductor as fvgraph's compiler calls it for a graph with copies
            return compile_fx(gm, example_inputs, config_patches=inductor_config(gm))

        got, code = run_and_get_code(torch.compile(toy, backend=backend, fullgraph=True), x)
    torch.testing.assert_close(got, want)
    assert torch.equal(toy.slot0, toy.host2) and torch.equal(toy.slot1, toy.host3)
    assert "clone" not in "".join(code)


def test_a_step_with_streamed_blocks_loads_from_the_capture_cache_and_is_written_in_place(tmp_path):
    """aot_eager's artifact is the graph before AOTAutograd: a load compiles it through the same
    rewrite, so a second engine on the cache compiles nothing, equals no offload, and holds no clone."""
    config = dict(device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"), buckets=BucketSpec(batch_sizes=(1,)))
    want, plain, _ = _run("aot_eager", None)
    Engine.from_card(four_block_wan(), offload="blocks:1", cache_dir=tmp_path, **config).warmup([REQUEST])
    loaded = Engine.from_card(four_block_wan(), offload="blocks:1", cache_dir=tmp_path, **config)
    loaded.warmup([REQUEST])
    assert (loaded.counters.compiles, loaded.counters.capture_cache_hits) == (0, 1)
    peaks = _step_peaks(loaded)
    [got] = loaded.generate([REQUEST])
    assert torch.equal(want, got.latents)
    assert _no_more_than(peaks, plain), (peaks, plain)
