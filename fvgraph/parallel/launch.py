"""Starting a parallel engine: rank 0 spawns the worker ranks, builds its own parts as one of them,
and runs its executor behind a ParallelExecutor.

    parts = build_parallel_parts(card, checkpoint, level, device, switches)   # switches.parallel set

Order: the plan is checked against the card's own denoiser config where the card carries one (before
any process starts), the workers are spawned, rank 0 builds (joining the group, whose creation waits
for every rank, then loading, splitting and checking the plan against the loaded weights), and only
then does it wait for the workers to report ready. Any failure stops the workers it started.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fvgraph.card import ModelCard
from fvgraph.parallel.executor import ParallelExecutor
from fvgraph.parallel.plan import DENOISERS
from fvgraph.parallel.workers import WorkerGroup
from fvgraph.runtime.engine_builder import EngineParts, EngineSwitches, build_engine_parts


def build_parallel_parts(card: ModelCard, checkpoint: str | Path | None, level: int,
                         device: str | torch.device | None, switches: EngineSwitches) -> EngineParts:  # fmt: skip
    config = switches.parallel
    if switches.taps:
        raise ValueError("taps=True (the parity variant) cannot run with `parallel`: build a parity engine without it")
    for name in DENOISERS:
        spec = card.components.get(name)
        if spec is not None and spec.config and "num_attention_heads" in spec.config:
            config.check_heads(spec.config["num_attention_heads"])
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    build = dict(card=card, checkpoint=None if checkpoint is None else str(checkpoint), level=level,
                 device=str(device), switches=switches)  # fmt: skip
    workers, init_method = WorkerGroup.spawn(config, build)
    try:
        parts = build_engine_parts(card, checkpoint, level, device, switches, rank=0, init_method=init_method)
        workers.wait_ready()
    except BaseException:
        workers.close()
        raise
    parts.executor = ParallelExecutor(parts.executor, workers, parts.parallel.split, parts.parallel.refused)
    return parts
