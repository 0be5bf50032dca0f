"""Applying a ParallelConfig to one rank's step modules: the process group, the mesh, the splits.

The order matters and is the same on every rank: join the process group, build the (cfg, ring,
ulysses) device mesh (its sub-groups are created collectively), then split the step modules — Ulysses
on each denoiser the loop's denoise steps call, CFG-parallel on each denoise step that runs both
branches. Only `DenoiseStep` kinds are split; the kinds that do not touch a denoiser (text encoding,
VAE) run on rank 0 alone, and a kind that calls a denoiser in a way the plan does not cover (the
step-caching kinds, which skip the blocks) is refused by the parallel executor, by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fvgraph.contract.step_kind import StepKind
from fvgraph.loops.steps import DenoiseStep
from fvgraph.parallel.cfg_split import CfgSplit
from fvgraph.parallel.config import ParallelConfig
from fvgraph.parallel.ulysses import apply_ulysses

DENOISERS = ("transformer", "transformer_2")  # the components whose steps the plan splits


def join_process_group(config: ParallelConfig, rank: int, init_method: str, device: torch.device) -> None:
    """This process becomes `rank` of the engine's group: gloo on CPU, NCCL on CUDA."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one parallel engine "
                           "per process (close() the other engine first)")  # fmt: skip
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # NCCL and the device mesh use the current device
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.world_size,
                            timeout=timedelta(seconds=config.timeout_s))  # fmt: skip


def parallel_mesh(config: ParallelConfig, device: torch.device) -> DeviceMesh:
    """The (cfg, ring, ulysses) grid over the group's ranks; ring stays 1 (diffusers' context-parallel
    config reads a mesh with "ring" and "ulysses" dims)."""
    return init_device_mesh(device.type, (config.cfg, 1, config.ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))


def apply_parallel_plan(steps: dict[str, nn.Module], step_kinds: dict[str, StepKind], config: ParallelConfig,
                        mesh: DeviceMesh, device: torch.device) -> tuple[set[str], set[str]]:  # fmt: skip
    """Split this rank's step modules in place. Returns (kinds every rank runs, kinds no rank may run)."""
    rank = dist.get_rank()
    split, refused, denoisers = set(), set(), {}
    for kind, step in steps.items():
        declared = step_kinds.get(kind)
        if declared is None or declared.component not in DENOISERS:
            continue  # rank 0 runs it alone
        if type(step) is not DenoiseStep:
            refused.add(kind)
            continue
        split.add(kind)
        denoisers[id(step.transformer)] = step.transformer
        if step.cfg and config.cfg == 2:
            step.cfg_split = CfgSplit(mesh.get_local_rank("cfg"), mesh.get_group("cfg"))
    if config.ulysses > 1:
        for transformer in denoisers.values():
            apply_ulysses(transformer, mesh["ring", "ulysses"], rank, device)
    return split, refused




@dataclass
class RankSetup:
    """One rank's share of a parallel engine."""

    config: ParallelConfig
    rank: int
    split: set[str]  # kinds every rank runs together
    refused: set[str]  # kinds the plan cannot split

    @property
    def plan(self) -> str:
        return self.config.plan(self.rank)


def setup_rank(config: ParallelConfig, steps: dict[str, nn.Module], step_kinds: dict[str, StepKind], components,
               rank: int, init_method: str, device: torch.device) -> RankSetup:  # fmt: skip
    """Check the plan against the loaded weights, join the group, build the mesh and split this
    rank's step modules."""
    for name in DENOISERS:
        denoiser = getattr(components, name, None)
        if denoiser is not None:
            config.check_heads(denoiser.config.num_attention_heads)
    join_process_group(config, rank, init_method, device)
    split, refused = apply_parallel_plan(steps, step_kinds, config, parallel_mesh(config, device), device)
    return RankSetup(config, rank, split, refused)
