"""The step kinds of a First-Block Cache (FBCache) denoise step: two launches, decided in between.

FBCache decides from the step's own data whether the transformer blocks after the first run, so one
of its denoise steps is two launches (fvgraph/loops/fb_cache.py decides between them on the host):

    denoise[_cfg]_first_block      per CFG branch: embeddings and the first block. Returns the first
                                   block's output ("first_0", "first_1") and, small, "first_block_change"
                                   [B, branches, 2]: the mean |residual - kept residual| and the mean
                                   |kept residual| of the first block's residual against the one kept
                                   at the branch's last full step ("first_kept_b" in).
    denoise[_cfg]_after_first_<d>  per branch the remaining blocks (d = "c": compute, and keep their
                                   residual "kept_b" and the first block's "first_kept_b") or the kept
                                   residual added instead ("r": reuse), then the output section, the
                                   guidance combine and the sampler update. <d> has one letter per
                                   branch, cond first: the two branches decide apart, as diffusers
                                   keeps a "cond" and an "uncond" cache context.

The residuals are diffusers' (diffusers.hooks.first_block_cache, 0.42.1): the first block's is its
output minus its input; the kept one is the last block's output minus the first block's output, and
on reuse the blocks' output is the first block's output plus it. The second launch runs `embed`
again (cheap next to the blocks, and equal bit for bit) rather than carrying the embeddings over.
Every step is a pure tensor function, fixed at construction (which branches compute is the kind).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from fvgraph.compile.markers import mark_request_constant
from fvgraph.loops.loop import StepKind
from fvgraph.loops.samplers import FlowEulerSampler, UniPCSampler
from fvgraph.loops.steps import DenoiseStep
from fvgraph.loops.wan_forward_sections import embed, project_out

CHANGE = "first_block_change"  # the output the loop reads on the host
# The first-block kind by cfg, and the after-first kind by (cfg, which branches compute).
FIRST_BLOCK_KINDS = {cfg: f"denoise{'_cfg' if cfg else ''}_first_block" for cfg in (False, True)}
AFTER_FIRST_KINDS = {
    (cfg, compute): f"denoise{'_cfg' if cfg else ''}_after_first_{''.join('c' if c else 'r' for c in compute)}"
    for cfg in (False, True) for compute in itertools.product((True, False), repeat=2 if cfg else 1)
}  # fmt: skip
FB_STEP_KINDS = {
    **{kind: StepKind(kind, component="transformer", phase="denoise", compiled=True, host_outputs=(CHANGE,),
                       continues=True)
       for kind in FIRST_BLOCK_KINDS.values()},
    **{kind: StepKind(kind, component="transformer", phase="denoise", compiled=True, per_inference_step=True)
       for kind in AFTER_FIRST_KINDS.values()},
}  # fmt: skip


def build_fb_steps(transformer: nn.Module, sampler: FlowEulerSampler | UniPCSampler) -> dict[str, nn.Module]:
    steps: dict[str, nn.Module] = {kind: FirstBlockStep(transformer, cfg) for cfg, kind in FIRST_BLOCK_KINDS.items()}
    steps.update({kind: AfterFirstBlockStep(transformer, sampler, cfg, compute)
                  for (cfg, compute), kind in AFTER_FIRST_KINDS.items()})  # fmt: skip
    return steps


def first_block_shape(transformer: nn.Module, latents: torch.Tensor) -> tuple[int, int, int]:
    """[1, S, D]: the first block's tokens for batch-1 `latents` [1, C, F, H, W]."""
    config = transformer.config
    _, _, frames, height, width = latents.shape
    p_t, p_h, p_w = config.patch_size
    return 1, (frames // p_t) * (height // p_h) * (width // p_w), config.num_attention_heads * config.attention_head_dim


class FirstBlockStep(nn.Module):
    """Per CFG branch the first block, and how its residual changed since the kept one (per row)."""

    def __init__(self, transformer: nn.Module, cfg: bool):
        super().__init__()
        self.transformer = transformer
        self.cfg = cfg

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, L, D]
        negative_prompt_embeds: torch.Tensor | None = None,
        **kept: torch.Tensor,  # first_kept_0 (, first_kept_1): [B, S, D], zeros before the first full step
    ) -> dict[str, torch.Tensor]:
        model_input = latents.to(prompt_embeds.dtype)
        texts = (prompt_embeds, negative_prompt_embeds) if self.cfg else (prompt_embeds,)
        out, changes = {}, []
        for b, text in enumerate(texts):
            tokens = embed(self.transformer, model_input, timestep, mark_request_constant(text))
            first = self.transformer.blocks[0](tokens.hidden_states, tokens.encoder_hidden_states,
                                               tokens.timestep_proj, tokens.rotary_emb)  # fmt: skip
            residual, previous = first - tokens.hidden_states, kept[f"first_kept_{b}"]
            # diffusers' (residual - previous).abs().mean() and previous.abs().mean(), per request row
            changes.append(torch.stack([(residual - previous).abs().mean(dim=(1, 2)), previous.abs().mean(dim=(1, 2))], dim=-1))
            out[f"first_{b}"] = first
        out[CHANGE] = torch.stack(changes, dim=1)  # [B, branches, 2]
        return out


class AfterFirstBlockStep(DenoiseStep):
    """The rest of an FBCache step; `compute[b]`: branch b runs the remaining blocks, else reuses."""

    def __init__(self, transformer: nn.Module, sampler: FlowEulerSampler | UniPCSampler, cfg: bool,
                 compute: tuple[bool, ...]):  # fmt: skip
        super().__init__(transformer, sampler, cfg)
        if len(compute) != (2 if cfg else 1):
            raise ValueError(f"compute={compute} must hold one decision per CFG branch ({2 if cfg else 1})")
        self.compute = compute

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, L, D]
        coeffs: torch.Tensor,  # [B, num_coeffs]
        negative_prompt_embeds: torch.Tensor | None = None,
        guidance_scale: torch.Tensor | None = None,
        **extra: torch.Tensor,  # carry_0..; first_b (the first block's output); kept_b for a reused branch
    ) -> dict[str, torch.Tensor]:
        # 1. each branch: the remaining blocks (their residual kept) or the kept residual, then the output
        model_input = latents.to(prompt_embeds.dtype)
        texts = (prompt_embeds, negative_prompt_embeds)
        out, noises = {}, []
        for b, compute in enumerate(self.compute):
            tokens = embed(self.transformer, model_input, timestep, mark_request_constant(texts[b]))
            first = extra[f"first_{b}"]
            if compute:
                hidden = first
                for block in list(self.transformer.blocks)[1:]:
                    hidden = block(hidden, tokens.encoder_hidden_states, tokens.timestep_proj, tokens.rotary_emb)
                out[f"kept_{b}"] = hidden - first
                out[f"first_kept_{b}"] = first - tokens.hidden_states
            else:
                hidden = extra[f"kept_{b}"] + first  # diffusers' FBCHeadBlockHook: tail residual + head output
            noises.append(project_out(self.transformer, hidden, tokens))
        # 2. the guidance combine and the sampler update, as DenoiseStep
        noise = self._guided(noises[0], noises[1], guidance_scale) if self.cfg else noises[0]
        out.update(self._sampler_step(latents, noise, extra, coeffs))
        return out
