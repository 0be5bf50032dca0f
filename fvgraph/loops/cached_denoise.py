"""The two denoise step kinds of a caching interceptor: a full step that keeps the blocks' residual,
and a reuse step that skips the blocks and adds the kept residual instead.

`wan_forward` is `WanTransformer3DModel.forward` (diffusers 0.42.1) with its block loop made
replaceable: the sections before and after the loop are diffusers' own lines, in the same order
(fvgraph/loops/wan_forward_sections.py), so a full step equals the plain denoise step bit for bit in
eager. The residual is the blocks' output minus the first block's input
(tokens [B, S, D]), as diffusers' MagCache hooks keep it; on reuse the block stack's output is that
input plus the kept residual, as those hooks return it.

The steps are pure tensor functions like DenoiseStep (fvgraph/loops/steps.py): whether a step keeps
or reuses is fixed when the module is built, never decided per call. Each branch calls the
`denoiser` submodule (`CachedWanForward`) between CFG-branch markers, its inputs (the kept residual
too) and both of its outputs marked, so at -O1 and up the CFG fusion pass runs the two calls as one
at twice the batch, as it does for the plain denoise step.
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.compile.markers import mark_branch_inputs, mark_branch_output, mark_request_constant
from fvgraph.loops.samplers import FlowEulerSampler, UniPCSampler
from fvgraph.loops.steps import DenoiseStep
from fvgraph.loops.wan_forward_sections import embed, project_out


def wan_forward(transformer: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None = None,
                kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(noise prediction, blocks' residual). With `kept` the blocks do not run: their output is
    their input plus `kept`, which is also the residual returned."""
    # 1. rotary embedding, patch embedding, condition embedding
    tokens = embed(transformer, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
    # 2. the transformer blocks, or the kept residual in their place
    block_input = hidden_states = tokens.hidden_states
    if kept is None:
        for block in transformer.blocks:
            hidden_states = block(hidden_states, tokens.encoder_hidden_states, tokens.timestep_proj, tokens.rotary_emb)
        residual = hidden_states - block_input
    else:
        hidden_states = block_input + kept
        residual = kept
    # 3. output norm, projection and unpatchify
    return project_out(transformer, hidden_states, tokens), residual


class CachedWanForward(nn.Module):
    """`wan_forward` as a module, so a step can mark its calls as CFG branches for the fusion pass."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None, kept: torch.Tensor | None = None,
                return_dict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return wan_forward(self.transformer, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image, kept)


class CachedDenoiseStep(DenoiseStep):
    """A whole denoise step that keeps (`reuse=False`) or reuses (`reuse=True`) the blocks' residual
    of each CFG branch: input/output "kept_0" (cond) and "kept_1" (uncond, when `cfg`)."""

    def __init__(self, transformer: nn.Module, sampler: FlowEulerSampler | UniPCSampler, cfg: bool, reuse: bool):
        super().__init__(transformer, sampler, cfg)
        self.denoiser = CachedWanForward(transformer)  # the same module: no weight copy
        self.reuse = reuse
        self.num_kept = 2 if cfg else 1

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, L, D]
        coeffs: torch.Tensor,  # [B, num_coeffs]
        negative_prompt_embeds: torch.Tensor | None = None,
        guidance_scale: torch.Tensor | None = None,
        condition: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        **extra: torch.Tensor,  # sampler history carry_0..; on reuse, kept_0.. ([B, S, D] each)
    ) -> dict[str, torch.Tensor]:
        # 1. the denoiser input, as DenoiseStep builds it
        model_input = latents if condition is None else torch.cat([latents, mark_request_constant(condition)], dim=1)
        model_input = model_input.to(prompt_embeds.dtype)
        image = {} if image_embeds is None else {"encoder_hidden_states_image": mark_request_constant(image_embeds)}
        # 2. each branch: blocks computed (residual kept) or skipped (residual reused)
        texts = (prompt_embeds, negative_prompt_embeds)
        noises, residuals = [], []
        for b, branch in enumerate(("cond", "uncond")[: self.num_kept]):
            inputs = dict(hidden_states=model_input, timestep=timestep, encoder_hidden_states=mark_request_constant(texts[b]),
                          **image, **({"kept": extra[f"kept_{b}"]} if self.reuse else {}))  # fmt: skip
            marked = dict(zip(inputs, mark_branch_inputs(branch, "denoiser", **inputs)))
            noise, residual = self.denoiser(**marked)
            noises.append(mark_branch_output(branch, "denoiser", noise, 0))
            residuals.append(mark_branch_output(branch, "denoiser", residual, 1))
        noise = self._guided(noises[0], noises[1], guidance_scale) if self.cfg else noises[0]
        # 3. the sampler update
        out = self._sampler_step(latents, noise, extra, coeffs)
        if not self.reuse:
            out.update({f"kept_{b}": r for b, r in enumerate(residuals)})
        return out
