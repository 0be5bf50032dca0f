"""What every step-caching step module shares: a family's denoiser sections, the sampler, the CFG
branches, and the end of the step (guidance combine and sampler update, fvgraph/contract/denoise_update.py).

Whether a step computes, reuses or forecasts is fixed when the module is built, never decided per
call: each is a pure tensor function, like the plain denoise step.

On an engine with adapter slots (fvgraph/adapters/slots.py) a step takes each row's adapter slots
and scales (`lora_index`, `lora_scale`) as the plain step does, and chooses them on the slot store
around its sections' calls, so every adapted linear the sections run (the first block's, TeaCache's
modulated input's) applies the request's adapters.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fvgraph.adapters.slots import ROW_INPUTS, SlotStore, slot_store
from fvgraph.contract.denoise_update import Sampler, guided, sampler_update
from fvgraph.contract.denoiser_sections import DenoiserSections
from fvgraph.contract.cfg_branches import call_branches
from fvgraph.contract.markers import mark_request_constant

BRANCHES = ("cond", "uncond")
UPDATE_INPUTS = ("coeffs", "guidance_scale", "fresh_noise")  # with the sampler's history: read by the update only


def update_only(name: str) -> bool:
    """Whether a denoise input is read by the guidance combine and the sampler update alone: a launch
    that runs no update (FBCache's first block, TeaCache's probe) takes every other input (latents,
    timestep and what the sections read)."""
    return name in UPDATE_INPUTS or name.startswith("carry_")


def relative_change(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[B, 2] per request row: mean |current - previous| and mean |previous| over the tokens, the two
    numbers whose ratio FBCache and TeaCache compare with their threshold (divided on the host)."""
    return torch.stack([(current - previous).abs().mean(dim=(1, 2)), previous.abs().mean(dim=(1, 2))], dim=-1)


class SectionsForward(nn.Module):
    """The denoiser run through its sections, returning (noise prediction, the blocks' residual on the
    stream). With `kept` the blocks do not run: the stream leaving them is the one entering them plus
    `kept`, which is also the residual returned. A module of its own so a step can mark its calls as
    CFG branches for the fusion pass."""

    def __init__(self, sections: DenoiserSections):
        super().__init__()
        self.sections = sections

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, kept: torch.Tensor | None = None,
                return_dict: bool = False, lora_index: torch.Tensor | None = None, lora_scale: torch.Tensor | None = None,
                **conditions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # `return_dict`: the CFG fusion pass calls a branch's module as diffusers models are called
        store = adapter_slots(self.sections)
        if store is not None:
            store.choose(lora_index, lora_scale)
        noise, residual = self._sections(hidden_states, timestep, kept, conditions)
        if store is not None:
            store.release()
        return noise, residual

    def _sections(self, hidden_states, timestep, kept, conditions) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.sections
        tokens = s.embed(hidden_states, timestep, **conditions)
        entering = s.stream(tokens.hidden_states, tokens)
        if kept is None:
            leaving = s.stream(s.remaining_blocks(s.first_block(tokens.hidden_states, tokens), tokens), tokens)
            residual = leaving - entering
        else:
            leaving, residual = entering + kept, kept
        return s.project_out(leaving, tokens), residual


class SectionsStep(nn.Module):
    """Base of the caching step modules: sections, sampler and CFG fixed at construction."""

    def __init__(self, sections: DenoiserSections, sampler: Sampler, cfg: bool):
        super().__init__()
        self.sections = sections
        self.sampler = sampler
        self.cfg = cfg
        self.branches = BRANCHES[: 2 if cfg else 1]
        self.fuse_branches = False  # CFG fusion (passes/cfg_fusion.py) sets it while the step is traced

    def adapter_rows(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rows' adapter slots and scales, marked as constant for the request ({} without them)."""
        return {name: mark_request_constant(inputs[name]) for name in ROW_INPUTS if name in inputs}

    def choose_rows(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Before a step calls its sections directly: the adapted linears read the rows' adapters."""
        store = adapter_slots(self.sections)
        if store is not None:
            rows = self.adapter_rows(inputs)
            store.choose(rows.get("lora_index"), rows.get("lora_scale"))

    def release_rows(self) -> None:
        store = adapter_slots(self.sections)
        if store is not None:
            store.release()

    def branch_conditions(self, inputs: Mapping[str, torch.Tensor], branch: int) -> dict[str, torch.Tensor]:
        """What the sections' `embed` takes for CFG branch `branch` besides latents and timestep, each
        marked as constant for the request (so -O1 hoists what the denoiser computes from it alone)."""
        conditions = self.sections.conditions(inputs, branch)
        return {name: mark_request_constant(t) for name, t in conditions.items() if t is not None}

    def branch_calls(self, hidden_states: torch.Tensor, timestep: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                     kept: list[torch.Tensor] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """Each CFG branch's call of the step's `denoiser` (a SectionsForward) between branch markers,
        `kept[b]` the residual branch b reuses: [(noise prediction, residual)] per branch, marked, and
        fused into one call while the step is traced with CFG fusion (fvgraph/contract/cfg_branches.py)."""
        calls = {
            branch: dict(hidden_states=hidden_states, timestep=timestep, **({} if kept is None else {"kept": kept[b]}),
                         **self.branch_conditions(inputs, b), **self.adapter_rows(inputs))
            for b, branch in enumerate(self.branches)
        }  # fmt: skip
        outputs = call_branches("denoiser", self.denoiser, calls, self.fuse_branches)
        return [outputs[branch] for branch in self.branches]

    def finish(self, latents: torch.Tensor, noises: list[torch.Tensor], guidance_scale: torch.Tensor | None,
               carry: Mapping[str, torch.Tensor], coeffs: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
        """The guidance combine (when CFG) and the sampler update from each branch's noise prediction
        (`carry`: the step's inputs, of which the update reads the sampler's history)."""
        noise = guided(noises[0], noises[1], guidance_scale) if self.cfg else noises[0]
        return sampler_update(self.sampler, latents, noise, carry, coeffs)

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        """(tokens, head_dim, dtype) of the denoiser's self-attention (fvgraph.kernels.attention)."""
        return self.sections.attention_shape(inputs)


def adapter_slots(sections: DenoiserSections) -> SlotStore | None:
    """The slot store of the sections' denoiser, if it has adapter slots."""
    transformer = getattr(sections, "transformer", None)
    return None if transformer is None else slot_store(transformer)
