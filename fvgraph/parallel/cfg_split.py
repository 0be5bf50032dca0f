"""CFG-parallel: each rank of a CFG pair runs one guidance branch; an all-gather brings both back.

    step.cfg_split = CfgSplit(cfg_rank, mesh["cfg"].get_group())

The denoise step (fvgraph/loops/steps.py) then calls the denoiser once, on the conditional inputs on
cfg rank 0 and on the unconditional ones on cfg rank 1, and all-gathers the two noise predictions
with a functional collective, so the gather is a node of the compiled step. Both ranks combine them
and apply the sampler update, so both hold the same new latents and nothing else is sent back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

BRANCHES = ("cond", "uncond")
# torch 2.13 renamed all_gather_tensor (deprecated there, the only name on torch 2.11).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class CfgSplit:
    """The branch this rank runs (fixed when the step is built: a Python constant to the trace)."""

    def __init__(self, cfg_rank: int, group: dist.ProcessGroup):
        if cfg_rank not in (0, 1):
            raise ValueError(f"cfg_rank={cfg_rank} must be 0 (conditional branch) or 1 (unconditional)")
        self.cfg_rank = cfg_rank
        self.group = group

    @property
    def branch(self) -> str:
        return BRANCHES[self.cfg_rank]

    def both_branches(self, denoise: Callable[[str, torch.Tensor], torch.Tensor], cond_embeds: torch.Tensor,
                      uncond_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(cond noise, uncond noise): this rank's branch through `denoise(branch, embeds)`, the other
        rank's by all-gather along the batch dim."""
        mine = denoise(self.branch, (cond_embeds, uncond_embeds)[self.cfg_rank]).contiguous()
        both = _all_gather(mine, gather_dim=0, group=self.group)
        cond, uncond = both.chunk(2, dim=0)
        return cond, uncond
