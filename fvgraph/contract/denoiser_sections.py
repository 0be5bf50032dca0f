"""A denoiser cut around its block stack: what step caching needs of a model family.

Every step-caching method (fvgraph/caching/) runs the denoiser in parts: the blocks are computed,
skipped for a kept residual, split after the first block, or not run at all. A family makes itself
cacheable by implementing these sections once (Wan: fvgraph/models/wan_sections.py; FLUX:
fvgraph/models/flux_sections.py) such that

    tokens = sections.embed(x, t, **sections.conditions(step_inputs, branch))
    hidden = sections.remaining_blocks(sections.first_block(tokens.hidden_states, tokens), tokens)
    noise = sections.project_out(sections.stream(hidden, tokens), tokens)

equals the denoiser's own forward, bit for bit in eager. Each is a pure tensor function.

`hidden` is what the blocks pass from one to the next: Wan's video tokens, or FLUX's text stream
followed by its image tokens. `stream` is the part the output section reads, the part a caching
method keeps residuals of and compares (all of Wan's; FLUX's image tokens, since its text stream is
dropped after the blocks): diffusers' cache hooks treat the block outputs' `hidden_states` the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class DenoiserTokens(Protocol):
    """What `embed` hands to the blocks: at least the first block's input; the rest is the family's."""

    hidden_states: torch.Tensor  # [B, S', D] the blocks' state entering the first block


class DenoiserSections(Protocol):
    # What TeaCache's published decision for the family reads: "timestep" (the timestep embedding,
    # known before the run: Wan) or "modulated_input" (the first block's modulated input, known only
    # once the step runs: FLUX, which then has `modulated_input(tokens)`).
    teacache_signal: str

    def conditions(self, inputs: Mapping[str, torch.Tensor], branch: int) -> dict[str, Any]:
        """`embed`'s keyword arguments besides the latents and timestep for CFG branch `branch` (0 cond,
        1 uncond), taken from a denoise step's inputs (the texts and whatever else the family's
        denoiser reads, all constant for the request)."""
        ...

    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **conditions: Any) -> DenoiserTokens: ...

    def first_block(self, hidden: torch.Tensor, tokens: DenoiserTokens) -> torch.Tensor: ...

    def remaining_blocks(self, hidden: torch.Tensor, tokens: DenoiserTokens) -> torch.Tensor: ...

    def stream(self, hidden: torch.Tensor, tokens: DenoiserTokens) -> torch.Tensor:
        """[B, S, D]: the part of the blocks' state the output section reads and caching keeps."""
        ...

    def project_out(self, stream: torch.Tensor, tokens: DenoiserTokens) -> torch.Tensor: ...

    def modulated_input(self, tokens: DenoiserTokens) -> torch.Tensor:
        """[B, S, D]: the first block's modulated input of the stream (where `teacache_signal` names it)."""
        ...

    def token_shape(self, latents: torch.Tensor, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        """[1, S, D]: the stream's shape for batch-1 `latents` (what a kept residual is); `condition`:
        an edit's image latents, whose tokens join the stream where the family joins them (FLUX.1 Kontext)."""
        ...

    def hidden_shape(self, latents: torch.Tensor, text_tokens: int, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        """[1, S', D]: the blocks' whole state for batch-1 `latents` and a text of `text_tokens`."""
        ...

    @property
    def token_dtype(self) -> torch.dtype:
        """The dtype the blocks' tokens are in (a kept residual before the first full step is zeros of it)."""
        ...
