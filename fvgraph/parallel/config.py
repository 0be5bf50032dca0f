"""ParallelConfig: how many processes run one engine's steps, and how a step is split across them.

    engine = Engine.from_card("tiny-wan", opt_level=1, parallel=ParallelConfig(cfg=2))

The ranks form a (cfg, ulysses) grid, rank = cfg_rank * ulysses + ulysses_rank. A CFG-parallel pair
runs the conditional branch on cfg rank 0 and the unconditional one on cfg rank 1; a Ulysses group
splits the denoiser's tokens and swaps them for heads around self-attention (docs/parallel.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ParallelConfig(BaseModel):
    """Degrees of one parallel engine; 1 x 1 runs the parallel code path in a group of one process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cfg: Literal[1, 2] = Field(default=1, description="CFG-parallel degree: 2 runs cond and uncond on two ranks.")
    ulysses: int = Field(default=1, ge=1, le=64, description="Ulysses degree: ranks that split the tokens "
                         "of one denoiser call; must divide the denoiser's attention head count.")  # fmt: skip
    timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Longest a rank waits for another "
                             "(a collective, a step's answer) before the batch fails as a lost worker.")  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses

    def plan(self, rank: int) -> str:
        """The signature factor: a rank's compiled step depends on the split and on its place in it
        (cfg rank 1 traces the unconditional branch)."""
        return f"cfg{self.cfg}xulysses{self.ulysses}:rank{rank}"

    def check_heads(self, num_heads: int) -> None:
        """Ulysses gives each rank num_heads / ulysses whole heads."""
        if num_heads % self.ulysses:
            raise ValueError(
                f"ParallelConfig.ulysses={self.ulysses} must divide the denoiser's attention head count "
                f"({num_heads}): each rank attends over whole heads; choose a divisor of {num_heads}"
            )
