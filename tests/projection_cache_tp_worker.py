"""One rank of the two-process ExactProjectionCache test (gloo, CPU, loopback only).

Usage: python projection_cache_tp_worker.py RANK WORLD_SIZE INIT_FILE RESULT_JSON, or from a test
``run_two_ranks(tmp_path)``, which starts both ranks and returns their results.

Scenario: both ranks miss and store; rank 1 alone clears its cache; on the next call rank 0 still
holds the entry, yet both ranks must recompute; on the call after that both ranks hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fvgraph.runtime.projection_cache import ExactProjectionCache


def _run(rank: int) -> dict:
    torch.manual_seed(0)  # same weights and conditioning on both ranks
    projection = nn.Linear(8, 16)
    conditioning = torch.randn(2, 8)
    cache = ExactProjectionCache(max_bytes=1 << 20)
    computes = []

    def compute() -> torch.Tensor:
        computes.append(1)
        return projection(conditioning)

    phases = {}
    with torch.no_grad():
        expected = projection(conditioning)
        cache.prepare(conditioning)
        first = cache.project("mod", projection, conditioning, compute)
        phases["first"] = _snapshot(cache, computes, torch.equal(first, expected))
        if rank == 1:
            cache.clear()  # rank-local miss on the next call
            cache.prepare(conditioning)
        dist.barrier()
        second = cache.project("mod", projection, conditioning, compute)
        phases["second"] = _snapshot(cache, computes, torch.equal(second, expected))
        third = cache.project("mod", projection, conditioning, compute)
        phases["third"] = _snapshot(cache, computes, torch.equal(third, expected))
    return phases


def _snapshot(cache: ExactProjectionCache, computes: list, correct: bool) -> dict:
    stats = cache.stats
    return {
        "hits": stats.hits,
        "misses": stats.misses,
        "tp_forced_misses": stats.tp_forced_misses,
        "entries": stats.entries,
        "computes": len(computes),
        "correct": correct,
    }


def run_two_ranks(tmp_path: Path, timeout_s: float) -> list[dict]:
    """Start ranks 0 and 1 as subprocesses; fail the calling test if either errors or hangs."""
    import pytest  # only the test process needs it

    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")  # loopback only
    init, out = tmp_path / "init", [tmp_path / f"rank{rank}.json" for rank in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), "2", str(init), str(out[rank])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    deadline, logs = time.monotonic() + timeout_s, []
    try:
        for proc in procs:
            remaining = max(deadline - time.monotonic(), 1.0)
            logs.append(proc.communicate(timeout=remaining)[0].decode())
    except subprocess.TimeoutExpired:
        pytest.fail("a rank hung: the hit/miss all-reduce was not entered by every rank")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if [p.returncode for p in procs] != [0, 0]:
        pytest.fail("a rank failed:\n" + "\n".join(logs))
    return [json.loads(path.read_text()) for path in out]


def main() -> None:
    rank, world_size, init_file, result_path = sys.argv[1:5]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=int(rank),
        world_size=int(world_size),
        timeout=timedelta(seconds=60),
    )
    try:
        result = _run(int(rank))
    finally:
        dist.destroy_process_group()
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
