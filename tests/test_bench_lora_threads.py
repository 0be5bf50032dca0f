"""perf/bench_lora.py on the CPU runs torch on one thread unless --threads says otherwise (its
docstring: on a shared CPU a pool of one thread per core makes a step's wall time follow its op
count, which hid what the slot path costs), and the result line's torch_threads says which."""

import pytest
import torch

from fvgraph.perf import bench_lora


@pytest.fixture
def threads_seen(monkeypatch):
    """main() up to the benchmark: the torch thread count the benchmark would run with."""
    seen = []
    before = torch.get_num_threads()
    monkeypatch.setattr(bench_lora, "bench", lambda *args: seen.append(torch.get_num_threads()) or {})
    monkeypatch.setattr(bench_lora, "emit", lambda line: None)
    yield seen
    torch.set_num_threads(before)


def test_the_cpu_bench_runs_on_one_thread_by_default(threads_seen):
    torch.set_num_threads(2)
    bench_lora.main(["--no-references"])
    assert threads_seen == [1]


def test_threads_says_how_many(threads_seen):
    bench_lora.main(["--threads", "2"])
    assert threads_seen == [2]


def test_threads_below_one_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--threads=0 must be >= 1"):
        bench_lora.main(["--threads", "0"])
