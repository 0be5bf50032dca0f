"""Building an engine: this process's parts, and with `switches.parallel` its worker ranks.

    parts = build_engine_parts(card, checkpoint, opt_level=2, device="cuda", switches=EngineSwitches())

A parallel engine is built in one pass, in this order: the plan is checked against the card's own
denoiser config where the card carries one (before any process starts), the workers are spawned
(fvgraph/engine/worker_rank.py), this process builds its own parts as rank 0 (joining the group,
whose creation waits for every rank, then loading, splitting and checking the plan against the
loaded weights), and only then waits for the workers to report ready. Any failure stops the workers
it started.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fvgraph.card import ModelCard
from fvgraph.engine.parts import EngineParts, EngineSwitches, build_rank_parts, check_offload
from fvgraph.engine.worker_rank import WorkerBuild, worker_main
from fvgraph.parallel.executor import ParallelExecutor
from fvgraph.parallel.plan import DENOISERS
from fvgraph.parallel.workers import WorkerGroup


def build_engine_parts(card: ModelCard, checkpoint: str | Path | None, level: int, device: str | torch.device | None,
                       switches: EngineSwitches) -> EngineParts:  # fmt: skip
    """The parts of this process's engine; with `switches.parallel`, rank 0's, behind the workers it starts."""
    if switches.parallel is None:
        return build_rank_parts(card, checkpoint, level, device, switches)
    config = switches.parallel
    if switches.taps:
        raise ValueError("taps=True (the parity variant) cannot run with `parallel`: build a parity engine without it")
    check_offload(switches)
    for name in DENOISERS:
        spec = card.components.get(name)
        if spec is not None and spec.config and "num_attention_heads" in spec.config:
            config.check_heads(spec.config["num_attention_heads"])
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt = None if checkpoint is None else str(checkpoint)
    build = functools.partial(WorkerBuild, card, ckpt, level, str(device), switches)
    workers, init_method = WorkerGroup.spawn(config, worker_main, build)
    try:
        parts = build_rank_parts(card, checkpoint, level, device, switches, rank=0, init_method=init_method)
        workers.wait_ready()
    except BaseException:
        workers.close()
        raise
    parts.executor = ParallelExecutor(parts.executor, workers, parts.parallel.split, parts.parallel.refused)
    return parts
