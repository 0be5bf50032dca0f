"""What every step-caching step module shares: a family's denoiser sections, the sampler, the CFG
branches, and the end of the step (guidance combine and sampler update, fvgraph/contract/denoise_update.py).

Whether a step computes, reuses or forecasts is fixed when the module is built, never decided per
call: each is a pure tensor function, like the plain denoise step.
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.contract.denoise_update import Sampler, guided, sampler_update
from fvgraph.contract.denoiser_sections import DenoiserSections

BRANCHES = ("cond", "uncond")


class SectionsForward(nn.Module):
    """The denoiser run through its sections, returning (noise prediction, the blocks' residual). With
    `kept` the blocks do not run: their output is their input plus `kept`, which is also the residual
    returned. A module of its own so a step can mark its calls as CFG branches for the fusion pass."""

    def __init__(self, sections: DenoiserSections):
        super().__init__()
        self.sections = sections

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                kept: torch.Tensor | None = None, return_dict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # `return_dict`: the CFG fusion pass calls a branch's module as diffusers models are called
        s = self.sections
        tokens = s.embed(hidden_states, timestep, encoder_hidden_states)
        block_input = tokens.hidden_states
        if kept is None:
            hidden = s.remaining_blocks(s.first_block(block_input, tokens), tokens)
            residual = hidden - block_input
        else:
            hidden, residual = block_input + kept, kept
        return s.project_out(hidden, tokens), residual


class SectionsStep(nn.Module):
    """Base of the caching step modules: sections, sampler and CFG fixed at construction."""

    def __init__(self, sections: DenoiserSections, sampler: Sampler, cfg: bool):
        super().__init__()
        self.sections = sections
        self.sampler = sampler
        self.cfg = cfg
        self.branches = BRANCHES[: 2 if cfg else 1]

    def finish(self, latents: torch.Tensor, noises: list[torch.Tensor], guidance_scale: torch.Tensor | None,
               carry: dict[str, torch.Tensor], coeffs: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
        """The guidance combine (when CFG) and the sampler update from each branch's noise prediction."""
        noise = guided(noises[0], noises[1], guidance_scale) if self.cfg else noises[0]
        return sampler_update(self.sampler, latents, noise, carry, coeffs)

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        """(tokens, head_dim, dtype) of the denoiser's self-attention (fvgraph.kernels.attention)."""
        return self.sections.attention_shape(inputs)
