"""A denoiser cut around its block stack: what step caching needs of a model family.

Every step-caching method (fvgraph/caching/) runs the denoiser in parts: the blocks are computed,
skipped for a kept residual, split after the first block, or not run at all. A family makes itself
cacheable by implementing these sections once (Wan: fvgraph/models/wan_sections.py) such that

    tokens = sections.embed(x, t, text, **conditions)
    hidden = sections.remaining_blocks(sections.first_block(tokens.hidden_states, tokens), tokens)
    noise = sections.project_out(hidden, tokens)

equals the denoiser's own forward, bit for bit in eager. Each is a pure tensor function.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class DenoiserTokens(Protocol):
    """What `embed` hands to the blocks: at least the first block's input; the rest is the family's."""

    hidden_states: torch.Tensor  # [B, S, D] tokens entering the first block


class DenoiserSections(Protocol):
    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              **conditions: Any) -> DenoiserTokens: ...  # fmt: skip

    def first_block(self, hidden: torch.Tensor, tokens: DenoiserTokens) -> torch.Tensor: ...

    def remaining_blocks(self, hidden: torch.Tensor, tokens: DenoiserTokens) -> torch.Tensor: ...

    def project_out(self, hidden: torch.Tensor, tokens: DenoiserTokens) -> torch.Tensor: ...

    def token_shape(self, latents: torch.Tensor) -> tuple[int, int, int]:
        """[1, S, D]: the blocks' tokens for batch-1 `latents`."""
        ...

    @property
    def token_dtype(self) -> torch.dtype:
        """The dtype the blocks' tokens are in (a kept residual before the first full step is zeros of it)."""
        ...
