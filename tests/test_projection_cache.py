"""ExactProjectionCache: exact reuse, invalidation, bypass, byte budget, and no collective in a distributed process.

Every invalidation or bypass rule has its own test, written so that removing the rule makes the
test fail (a stale value would be returned, or a hit would be counted where none is allowed).
"""

from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_forward_hook as global_hook
from torch.nn.modules.module import register_module_forward_pre_hook as global_pre_hook

from fvgraph.runtime.projection_cache import ExactProjectionCache, ProjectionCacheStats


def counted(fn) -> Mock:
    """A compute() that records how often the original computation ran (``.call_count``)."""
    return Mock(side_effect=fn)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    return nn.Linear(8, 16), torch.randn(2, 8), ExactProjectionCache(max_bytes=1 << 20)


def _counts(stats: ProjectionCacheStats) -> tuple[int, int, dict]:
    return stats.hits, stats.misses, stats.bypasses


# -- the documented usage, in its order ------------------------------------------------------


@torch.no_grad()
def test_the_documented_usage_runs_in_its_order():
    """docs/projection_cache.md's usage as written: a cache with a byte budget, prepare() on the
    conditioning, then project() for each projection; then the rules it states, one after another."""
    torch.manual_seed(0)
    projection, conditioning = nn.Linear(8, 16), torch.randn(2, 8)  # each output: 2 x 16 fp32 = 128 bytes
    cache = ExactProjectionCache(max_bytes=2 * 128)

    cache.prepare(conditioning)
    assert cache.stats.hashes == 1  # the key is computed here, once
    modulation = cache.project("block.0.modulation", projection, conditioning, lambda: projection(F.silu(conditioning)))
    assert torch.equal(modulation, projection(F.silu(conditioning)))

    compute = counted(lambda: projection(F.silu(conditioning)))  # warm: the stored tensor, bit for bit
    assert cache.project("block.0.modulation", projection, conditioning, compute) is modulation
    assert compute.call_count == 0

    projection.weight.add_(0.5)  # an in-place update invalidates the entry
    updated = cache.project("block.0.modulation", projection, conditioning, lambda: projection(F.silu(conditioning)))
    assert torch.equal(updated, projection(F.silu(conditioning))) and not torch.equal(updated, modulation)
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.invalidations, stats.hashes, stats.unprepared_hashes) == (1, 2, 1, 1, 0)

    handle = projection.register_forward_hook(lambda module, args, out: out)  # a hook: steps aside
    cache.project("block.0.modulation", projection, conditioning, lambda: projection(F.silu(conditioning)))
    handle.remove()
    with torch.enable_grad():  # gradients on: steps aside, and the output has its autograd graph
        graded = cache.project("block.0.modulation", projection, conditioning, lambda: projection(F.silu(conditioning)))
    assert graded.grad_fn is not None
    assert cache.stats.bypasses == {"module_hooks": 1, "grad_enabled": 1}

    for block in (1, 2):  # three outputs against a budget of two: the oldest goes
        cache.project(f"block.{block}.modulation", projection, conditioning, lambda: projection(F.silu(conditioning)))
        assert cache.stats.bytes_held <= cache.max_bytes
    stats = cache.stats
    assert (stats.entries, stats.bytes_held, stats.evictions) == (2, 256, 1)

    cache.clear()
    stats = cache.stats
    assert (stats.entries, stats.bytes_held) == (0, 0)
    compute = counted(lambda: projection(F.silu(conditioning)))
    cache.project("block.2.modulation", projection, conditioning, compute)
    assert compute.call_count == 1 and cache.stats.unprepared_hashes == 1  # clear() forgot the key too


# -- prepare ---------------------------------------------------------------------------------


@torch.no_grad()
def test_prepare_hashes_once_for_all_the_projections_that_follow(setup):
    proj, cond, cache = setup
    cache.prepare(cond)
    cache.prepare(cond)  # prepared already and unchanged: not hashed again
    for name in ("a", "b", "c"):
        cache.project(name, proj, cond, lambda: proj(cond))
    stats = cache.stats
    assert (stats.hashes, stats.unprepared_hashes, stats.misses) == (1, 0, 3)
    cond.add_(1)  # against the contract; prepare sees the new version and hashes again
    cache.prepare(cond)
    assert cache.stats.hashes == 2


@torch.no_grad()
def test_project_without_prepare_hashes_on_first_use(setup):
    proj, cond, cache = setup
    for name in ("a", "b"):
        cache.project(name, proj, cond, lambda: proj(cond))
    assert torch.equal(cache.project("a", proj, cond, lambda: proj(cond)), proj(cond))
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.hashes, stats.unprepared_hashes) == (1, 2, 1, 1)


def test_prepare_hashes_nothing_where_every_projection_steps_aside(setup, monkeypatch):
    proj, cond, cache = setup
    cache.prepare(cond)  # gradients on
    with torch.no_grad():
        handle = global_hook(lambda *args: None)
        try:
            cache.prepare(cond)
        finally:
            handle.remove()
        with monkeypatch.context() as capture:
            capture.setattr(torch.cuda, "is_available", lambda: True)
            capture.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            cache.prepare(cond)
    assert cache.stats.hashes == 0 and cache.stats.bypasses == {}


@torch.no_grad()
def test_prepare_traces_whole_and_hashes_nothing(setup):
    proj, cond, cache = setup

    def step(x):
        cache.prepare(x)
        return cache.project("p", proj, x, lambda: proj(x))

    compiled, graphs = _compiled_counting_graphs(step)
    for _ in range(2):
        assert torch.equal(compiled(cond), proj(cond))
    assert len(graphs) == 1 and cache.stats.hashes == 0
    _assert_bypassed_after(cache, {"compiling": 1})


# -- cold vs warm parity ---------------------------------------------------------------------


@torch.no_grad()
def test_warm_hit_is_bit_identical_for_linear(setup):
    proj, cond, cache = setup
    cold = cache.project("p", proj, cond, lambda: proj(cond))
    compute = counted(lambda: proj(cond))
    warm = cache.project("p", proj, cond, compute)
    assert compute.call_count == 0
    assert torch.equal(warm, proj(cond)) and torch.equal(warm, cold)
    assert _counts(cache.stats) == (1, 1, {})


@torch.no_grad()
def test_warm_hit_is_bit_identical_with_fixed_preprocessing(setup):
    proj, cond, cache = setup
    cache.project("p", proj, cond, lambda: proj(F.silu(cond)))
    warm = cache.project("p", proj, cond, lambda: proj(F.silu(cond)))
    assert torch.equal(warm, proj(F.silu(cond)))
    assert cache.stats.hits == 1


@torch.no_grad()
def test_inference_mode_conditioning_is_cached(setup):
    proj, _, cache = setup
    with torch.inference_mode():  # pipelines often build conditioning here; it has no version
        cond = torch.randn(2, 8)
    cold = cache.project("p", proj, cond, lambda: proj(cond))
    assert cache.project("p", proj, cond, lambda: proj(cond)) is cold
    assert _counts(cache.stats) == (1, 1, {}) and cache.stats.hashes == 1  # hashed once, then remembered


@torch.no_grad()
def test_equal_content_in_a_new_tensor_hits_and_names_separate_entries(setup):
    proj, cond, cache = setup
    cache.project("a", proj, cond, lambda: proj(cond))
    copy = cond.clone()  # another tensor object: hashed too
    assert torch.equal(cache.project("a", proj, copy, lambda: proj(copy)), proj(cond))
    cache.project("b", proj, cond, lambda: proj(cond))
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.hashes, stats.entries) == (1, 2, 2, 2)


# -- invalidation ----------------------------------------------------------------------------


@torch.no_grad()
def test_inplace_weight_update_invalidates(setup):
    proj, cond, cache = setup
    cache.project("p", proj, cond, lambda: proj(cond))
    proj.weight.add_(1)  # same tensor, same storage, bumped version
    out = cache.project("p", proj, cond, lambda: proj(cond))
    assert torch.equal(out, proj(cond))
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.invalidations, stats.entries) == (0, 2, 1, 1)


@torch.no_grad()
def test_weight_storage_move_invalidates(setup):
    proj, cond, cache = setup
    cache.project("p", proj, cond, lambda: proj(cond))
    proj.weight.data = proj.weight.data.clone()  # same values and version, new storage
    cache.project("p", proj, cond, lambda: proj(cond))
    proj.to(torch.float64).to(torch.float32)  # a round trip through another dtype
    out = cache.project("p", proj, cond, lambda: proj(cond))
    assert torch.equal(out, proj(cond))
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.invalidations) == (0, 3, 2)


@torch.no_grad()
def test_new_weights_at_a_reused_address_are_caught(setup):
    proj, cond, cache = setup
    host = np.random.default_rng(0).standard_normal((16, 8), dtype=np.float32)
    proj.weight.data = torch.from_numpy(host)
    cache.project("p", proj, cond, lambda: proj(cond))
    # New weights land at the freed address with an unchanged version counter, as a caching
    # allocator can arrange after an offload or a checkpoint swap; only the storage differs.
    host += 1
    old_ptr = proj.weight.data_ptr()
    proj.weight.data = torch.from_numpy(host)
    assert proj.weight.data_ptr() == old_ptr
    out = cache.project("p", proj, cond, lambda: proj(cond))
    assert torch.equal(out, proj(cond))
    assert _counts(cache.stats)[:2] == (0, 2) and cache.stats.invalidations == 1


@torch.no_grad()
def test_mutated_conditioning_is_rehashed(setup):
    proj, cond, cache = setup
    cache.project("p", proj, cond, lambda: proj(cond))
    cond.mul_(2)  # against the contract, but the version counter makes it safe
    out = cache.project("p", proj, cond, lambda: proj(cond))
    assert torch.equal(out, proj(cond))
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.hashes) == (0, 2, 2)  # the version counter forced a rehash


@torch.no_grad()
def test_autocast_after_a_first_call_misses_then_fp32_hits_again(setup):
    proj, cond, cache = setup
    fp32 = cache.project("p", proj, cond, lambda: proj(cond))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = cache.project("p", proj, cond, lambda: proj(cond))
    assert low.dtype == torch.bfloat16 and cache.stats.misses == 2
    again = cache.project("p", proj, cond, lambda: proj(cond))
    assert again.dtype == torch.float32 and torch.equal(again, fp32)
    assert cache.stats.hits == 1


@torch.no_grad()
def test_matmul_precision_setting_is_part_of_the_key(setup, monkeypatch):
    proj, cond, cache = setup
    cache.project("p", proj, cond, lambda: proj(cond))
    # Patch the getter rather than the global setting, so no precision state leaks to other tests.
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    cache.project("p", proj, cond, lambda: proj(cond))
    assert _counts(cache.stats)[:2] == (0, 2)


@torch.no_grad()
def test_clear_forces_a_miss(setup):
    proj, cond, cache = setup
    cache.project("p", proj, cond, lambda: proj(cond))
    cache.clear()
    assert cache.stats.entries == 0 and cache.stats.bytes_held == 0
    out = cache.project("p", proj, cond, lambda: proj(cond))
    assert torch.equal(out, proj(cond)) and _counts(cache.stats)[:2] == (0, 2)


# -- bypass ----------------------------------------------------------------------------------


def _assert_bypassed(cache, proj, cond, reason, compute=None):
    compute = compute or (lambda: proj(cond))
    for _ in range(2):
        assert torch.equal(cache.project("p", proj, cond, compute), compute())
    stats = cache.stats
    assert stats.bypasses == {reason: 2}
    assert (stats.hits, stats.misses, stats.entries) == (0, 0, 0)


@torch.no_grad()
def test_forward_hook_on_projection_bypasses(setup):
    proj, cond, cache = setup
    proj.register_forward_hook(lambda mod, args, out: out + 1)
    _assert_bypassed(cache, proj, cond, "module_hooks")


@torch.no_grad()
def test_pre_hook_on_wrapped_submodule_bypasses(setup):
    linear, cond, cache = setup
    proj = nn.Sequential(nn.Identity(), linear)
    linear.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    _assert_bypassed(cache, proj, cond, "module_hooks")


@torch.no_grad()
@pytest.mark.parametrize("register", [global_hook, global_pre_hook])
def test_global_module_hook_bypasses(setup, register):
    proj, cond, cache = setup
    handle = register(lambda *args: None)
    try:
        _assert_bypassed(cache, proj, cond, "global_hooks")
    finally:
        handle.remove()


def test_grad_enabled_bypasses(setup):
    proj, cond, cache = setup
    _assert_bypassed(cache, proj, cond, "grad_enabled")
    out = cache.project("p", proj, cond, lambda: proj(cond))
    assert out.grad_fn is not None  # a fresh autograd graph, as the original computation has


def _compiled_counting_graphs(step):
    """`step` compiled whole, and the list of graphs its backend was handed (one per trace)."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(step, backend=counting_backend, fullgraph=True), graphs


def _assert_bypassed_after(cache, bypasses):
    stats = cache.stats
    assert stats.bypasses == bypasses and (stats.hits, stats.misses, stats.entries) == (0, 0, 0)


@torch.no_grad()
def test_compile_tracing_bypasses_without_recompiling(setup):
    proj, cond, cache = setup

    def step(x):
        return cache.project("p", proj, x, lambda: proj(F.silu(x))) * 2

    compiled, graphs = _compiled_counting_graphs(step)
    for _ in range(3):
        assert torch.equal(compiled(cond), proj(F.silu(cond)) * 2)
    assert len(graphs) == 1  # the bypass counter is not a guard: no recompile per call
    _assert_bypassed_after(cache, {"compiling": 1})  # counted once per trace


@torch.no_grad()
def test_cuda_graph_capture_bypasses(setup, monkeypatch):
    # Simulated so it runs on CPU; test_cuda_hits_and_real_graph_capture_bypass does it for real.
    proj, cond, cache = setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _assert_bypassed(cache, proj, cond, "cuda_graph_capture")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_cuda_hits_and_real_graph_capture_bypass():
    torch.manual_seed(0)
    proj = nn.Linear(64, 128, device="cuda")
    cond = torch.randn(2, 64, device="cuda")
    cache = ExactProjectionCache(max_bytes=1 << 20)
    cold = cache.project("p", proj, cond, lambda: proj(cond))
    assert cache.project("p", proj, cond, lambda: proj(cond)) is cold
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert cache.project("p", proj, cond, lambda: proj(cond)).dtype == torch.bfloat16
    side = torch.cuda.Stream()  # warm cuBLAS up off the capture stream, as CUDA graphs require
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        proj(cond)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cache.project("p", proj, cond, lambda: proj(cond))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, proj(cond))
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.bypasses) == (1, 2, {"cuda_graph_capture": 1})


def test_inference_mode_weights_bypass(setup):
    _, cond, cache = setup
    with torch.inference_mode():
        proj = nn.Linear(8, 16)
        _assert_bypassed(cache, proj, cond, "unversioned_inference_weights")


@torch.no_grad()
def test_tensor_subclass_weights_bypass(setup):
    class Tagged(torch.Tensor):
        pass

    proj, cond, cache = setup
    proj.weight = nn.Parameter(proj.weight.detach().as_subclass(Tagged))
    _assert_bypassed(cache, proj, cond, "tensor_subclass_weights")


# -- byte budget -----------------------------------------------------------------------------


@torch.no_grad()
def test_byte_budget_evicts_least_recently_used():
    torch.manual_seed(0)
    proj = nn.Linear(4, 8)  # each output: 1 x 8 float32 = 32 bytes
    cache = ExactProjectionCache(max_bytes=3 * 32)
    conds = [torch.randn(1, 4) for _ in range(10)]
    for cond in conds:
        cache.project("p", proj, cond, lambda c=cond: proj(c))
        assert cache.stats.bytes_held <= cache.max_bytes
    stats = cache.stats
    assert (stats.entries, stats.bytes_held, stats.evictions) == (3, 96, 7)
    newest, evicted = counted(lambda: proj(conds[-1])), counted(lambda: proj(conds[0]))
    cache.project("p", proj, conds[-1], newest)
    cache.project("p", proj, conds[0], evicted)
    assert (newest.call_count, evicted.call_count) == (0, 1)


@torch.no_grad()
def test_lru_keeps_recently_hit_entry():
    torch.manual_seed(0)
    proj = nn.Linear(4, 8)
    cache = ExactProjectionCache(max_bytes=2 * 32)
    a, b, c = (torch.randn(1, 4) for _ in range(3))
    for cond in (a, b, a, c):  # hitting a makes b the eviction victim
        cache.project("p", proj, cond, lambda x=cond: proj(x))
    keep = counted(lambda: proj(a))
    cache.project("p", proj, a, keep)
    assert keep.call_count == 0 and cache.stats.evictions == 1


@torch.no_grad()
def test_output_larger_than_budget_is_not_stored(setup):
    proj, cond, _ = setup
    cache = ExactProjectionCache(max_bytes=64)  # output is 2 x 16 float32 = 128 bytes
    for _ in range(2):
        assert torch.equal(cache.project("p", proj, cond, lambda: proj(cond)), proj(cond))
    _assert_bypassed_after(cache, {"too_large": 2})


# -- errors -------------------------------------------------------------


@torch.no_grad()
def test_errors_name_the_field_and_rule(setup):
    proj, cond, cache = setup
    with pytest.raises(ValueError, match="max_bytes=-1"):
        ExactProjectionCache(max_bytes=-1)
    with pytest.raises(TypeError, match="'p'.*single Tensor"):
        cache.project("p", proj, cond, lambda: (proj(cond), proj(cond)))


# -- no collective --------------------------------------------------------------------------


@torch.no_grad()
def test_an_eager_engine_in_a_distributed_process_enters_no_collective(monkeypatch):
    """A process that belongs to a group of two (a serving replica set, say) builds an -O0 engine:
    its projections are cached per process and call no torch.distributed function."""
    import torch.distributed as dist

    from fvgraph.request import Request
    from fvgraph.engine.engine import Engine

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for name in ("get_world_size", "get_backend", "all_reduce", "all_gather", "broadcast", "barrier"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name) or 2)
    engine = Engine.from_card("tiny-wan", device="cpu")
    [result] = engine.generate([Request(prompt="a", seed=0, num_inference_steps=2, num_frames=1, height=32, width=32)])
    assert result.ok, result.error
    assert engine.projection_cache.stats.hits > 0 and calls == []
