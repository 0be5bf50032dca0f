"""Worker processes of a parallel engine: spawned by rank 0, one per device, each a rank of the group.

Rank 0 is the engine's own process: it runs the scheduler and, for every batch of a split step kind,
sends the worker ranks the same call it makes itself (`run_batch(plans, slots, lane)`), so every rank
runs the same compiled step on its shard and enters the same collectives in the same order. A
worker answers each call with "ok" or the error it raised; rank 0 waits for every answer, watching
the processes, for at most `ParallelConfig.timeout_s`. A worker that dies or stops answering fails
that batch with `WorkersLost`, naming the rank, its pid and exit code, and from then on the group
refuses every call (the engine refuses new requests; the HTTP server answers 503).

Requests' runtime slots (fvgraph/runtime/request_slot.py) are mirrored: rank 0 numbers each slot it
sends, and tells the workers which numbers were released, so a worker's graph runner sees the same
row owners as rank 0's.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fvgraph.parallel.config import ParallelConfig
from fvgraph.runtime.request_slot import RequestSlot

log = logging.getLogger(__name__)


class WorkersLost(RuntimeError):
    """A worker rank died or stopped answering: the engine's parallel group is gone."""


class WorkerGroup:
    """Rank 0's handle on the worker ranks 1 .. world_size - 1."""

    def __init__(self, config: ParallelConfig, processes: list, conns: list, init_dir: str):
        self.config = config
        self.processes = processes
        self.conns = conns
        self.lost: str | None = None  # why the group is gone, once it is
        self._init_dir = init_dir
        self._serial = count()
        self._numbers: weakref.WeakKeyDictionary[RequestSlot, int] = weakref.WeakKeyDictionary()
        self._released: list[int] = []
        self.calls_done = [0] * len(processes)  # per worker rank (1, 2, ...): split step calls it answered "ok"

    @classmethod
    def spawn(cls, config: ParallelConfig, target: Callable, build: Callable[[str], Any]) -> tuple[WorkerGroup, str]:
        """Start the workers, each running `target(rank, config, build(init_method), conn)` (the
        engine's worker rank: fvgraph/engine/worker_rank.py); returns the group and the init method
        rank 0 joins with."""
        init_dir = tempfile.mkdtemp(prefix="fvgraph-group-")
        init_method = "file://" + str(Path(init_dir) / "init")
        context = mp.get_context("spawn")
        processes, conns = [], []
        for rank in range(1, config.world_size):
            ours, theirs = context.Pipe()
            process = context.Process(target=target, args=(rank, config, build(init_method), theirs),
                                      name=f"fvgraph-rank{rank}", daemon=True)  # fmt: skip
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        return cls(config, processes, conns, init_dir), init_method

    def wait_ready(self) -> None:
        for rank, answer in self._answers("starting", self.config.timeout_s):
            if answer[0] != "ready":
                self.close()
                raise RuntimeError(f"worker rank {rank} failed to start:\n{answer[1]}")

    def numbers(self, slots: list[RequestSlot]) -> list[int]:
        out = []
        for slot in slots:
            number = self._numbers.get(slot)
            if number is None:
                number = self._numbers[slot] = next(self._serial)
                weakref.finalize(slot, self._released.append, number)
            out.append(number)
        return out

    def send_run(self, kind: str, plans: list, slots: list[RequestSlot], lane: int, frozen: bool) -> None:
        """Hand every worker the call rank 0 is about to make."""
        self._check()
        released, self._released = self._released, []
        self._send(("run", plans, self.numbers(slots), lane, frozen, released), f"the start of a {kind} step")

    def ask(self, message: tuple, doing: str, ranks: list[int] | None = None) -> dict[int, tuple]:
        """Send `message` to the worker `ranks` (all by default) between steps; returns each one's
        answer, ("ok", value) or ("error", why), by rank (the adapters' loads: fvgraph/parallel/rank_adapters.py)."""
        self._check()
        ranks = list(range(1, len(self.processes) + 1)) if ranks is None else ranks
        self._send(message, doing, ranks)
        return dict(self._answers(doing, self.config.timeout_s, ranks))

    def _send(self, message: tuple, doing: str, ranks: list[int] | None = None) -> None:
        self.check_alive(doing)
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            if ranks is not None and rank not in ranks:
                continue
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionError, EOFError) as err:
                self._lose(f"worker rank {rank} (pid {process.pid}) cannot be reached ({err!r}) at {doing}")

    def collect(self, kind: str, grace: bool = False) -> None:
        """Wait for every worker's answer to the last call; raises WorkersLost or the worker's error.
        `grace`: rank 0 failed the call itself, so a worker may be waiting out a collective's timeout."""
        errors = []
        timeout = self.config.timeout_s * (2 if grace else 1)
        for rank, answer in self._answers(f"a {kind} step", timeout):
            if answer[0] == "error":
                errors.append(f"rank {rank}: {answer[1]}")
            else:
                self.calls_done[rank - 1] += 1
        if errors:
            raise RuntimeError(f"{kind} step failed on a worker rank:\n" + "\n".join(errors))

    def _answers(self, doing: str, timeout_s: float, ranks: list[int] | None = None):
        """Each worker's (of `ranks`: all by default) next answer, in rank order, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            if ranks is not None and rank not in ranks:
                continue
            while not conn.poll(0.05):
                if not process.is_alive():
                    self._lose(f"worker rank {rank} (pid {process.pid}) exited with code {process.exitcode} during {doing}")
                if time.monotonic() > deadline:
                    self._lose(f"worker rank {rank} (pid {process.pid}) did not answer within "
                               f"{timeout_s} s (ParallelConfig.timeout_s={self.config.timeout_s}) during {doing}")  # fmt: skip
            try:
                yield rank, conn.recv()
            except (EOFError, ConnectionError) as err:
                self._lose(f"worker rank {rank} (pid {process.pid}) closed its pipe ({err!r}) during {doing}")

    def summary(self) -> str:
        """One line naming each worker rank, its process and the step calls it ran."""
        ranks = ", ".join(f"rank {rank} (pid {process.pid}) ran {done} step calls"
                          for rank, (process, done) in enumerate(zip(self.processes, self.calls_done), start=1))  # fmt: skip
        return f"parallel group of {self.config.world_size} ranks (cfg={self.config.cfg}, ulysses={self.config.ulysses}): " + (
            ranks or "rank 0 alone")

    def check_alive(self, doing: str) -> None:
        """Raise WorkersLost if a worker has exited (after a collective failed, say why)."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                self._lose(f"worker rank {rank} (pid {process.pid}) exited with code {process.exitcode} during {doing}")

    def _lose(self, why: str) -> None:
        self.lost = self.lost or why
        raise WorkersLost(f"{why}; this engine's parallel group is gone and it takes no more work: "
                          "start a new engine")  # fmt: skip

    def _check(self) -> None:
        if self.lost is not None:
            raise WorkersLost(f"{self.lost}; this engine's parallel group is gone and it takes no more work: "
                              "start a new engine")  # fmt: skip

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the workers (asking first, then killing the ones that do not stop)."""
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, ConnectionError, EOFError, OSError):
                pass
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                process.kill()
                process.join(1.0)
        for conn in self.conns:
            conn.close()
        self.lost = self.lost or "the engine was closed"
        if dist.is_initialized():  # rank 0's membership goes with its workers
            dist.destroy_process_group()
        shutil.rmtree(self._init_dir, ignore_errors=True)
