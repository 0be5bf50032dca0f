"""A worker rank of a parallel engine: the process rank 0 spawns (fvgraph/parallel/workers.py), which
builds the same engine parts as rank 0 on its own device and runs every call rank 0 sends: a batch of
steps, or between ticks an adapter load or unload (fvgraph/parallel/rank_adapters.py)."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fvgraph.engine.parts import build_rank_parts
from fvgraph.parallel.config import ParallelConfig
from fvgraph.parallel.rank_adapters import MESSAGE as ADAPTERS
from fvgraph.parallel.rank_adapters import answer as adapter_answer
from fvgraph.runtime.request_slot import RequestSlot
from fvgraph.runtime.tf32_switch import math_mode


@dataclass(frozen=True)
class WorkerBuild:
    """What a worker needs to build the same engine parts as rank 0 (all picklable)."""

    card: object  # the ModelCard
    checkpoint: str | None
    level: int
    device: str  # rank 0's device; rank r uses the r-th device after it (CUDA) or the CPU
    switches: object  # the EngineSwitches
    init_method: str


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def worker_main(rank: int, config: ParallelConfig, build: WorkerBuild, conn) -> None:
    """A worker rank: build the engine parts, then run every call rank 0 sends until told to stop."""
    try:
        device = rank_device(torch.device(build.device), rank)
        if device.type == "cpu":  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
        parts = build_rank_parts(build.card, build.checkpoint, build.level, device, build.switches, rank=rank,
                                   init_method=build.init_method)  # fmt: skip
        math = math_mode(build.card.recipe.precision)
        executor = parts.executor
        compiler = executor.compiler
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready",))
    slots: dict[int, RequestSlot] = {}
    try:
        with math:  # this process only runs steps: its math mode is held for the whole loop
            while (message := conn.recv())[0] in ("run", ADAPTERS):
                if message[0] == ADAPTERS:  # between ticks: a load or unload on every rank
                    conn.send(adapter_answer(parts.adapters, *message[1:]))
                    continue
                _, plans, numbers, lane, frozen, released = message
                for number in released:
                    slots.pop(number, None)
                for plan in plans:
                    plan.inputs = {name: t.to(device) for name, t in plan.inputs.items()}
                if compiler is not None:
                    compiler.frozen = frozen
                try:
                    executor.run_batch(plans, [slots.setdefault(n, RequestSlot()) for n in numbers], lane)
                    conn.send(("ok",))
                except Exception:
                    conn.send(("error", traceback.format_exc(limit=4)))
    except (EOFError, ConnectionError):
        pass  # rank 0 went away
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
