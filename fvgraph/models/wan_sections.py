"""diffusers' `WanTransformer3DModel.forward` (diffusers 0.42.1) cut around its block loop: Wan's
denoiser sections (fvgraph/contract/denoiser_sections.py), which every step-caching method runs on.

`embed` is the forward's first section (rotary, patch and condition embeddings) and `project_out` its
last (output norm, projection, unpatchify), each line diffusers' own in diffusers' order, so

    tokens = embed(transformer, x, t, text)
    hidden = tokens.hidden_states
    for block in transformer.blocks:
        hidden = block(hidden, tokens.encoder_hidden_states, tokens.timestep_proj, tokens.rotary_emb)
    noise = project_out(transformer, hidden, tokens)

equals `transformer(x, t, text, return_dict=False)[0]` bit for bit in eager. Both are pure tensor
functions of their inputs: running `embed` again in a later launch gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn


TEXTS = ("prompt_embeds", "negative_prompt_embeds")  # the step input each CFG branch's text is


class WanTokens(NamedTuple):
    """What the blocks and the output section take from the embeddings."""

    hidden_states: torch.Tensor  # [B, S, D] patch tokens: the first block's input
    encoder_hidden_states: torch.Tensor  # [B, L, D] projected text (image tokens first, when given)
    timestep_proj: torch.Tensor  # [B, 6, D] ([B, S, 6, D] for per-token timesteps)
    temb: torch.Tensor  # [B, D] ([B, S, D] for per-token timesteps)
    rotary_emb: tuple[torch.Tensor, torch.Tensor]
    grid: tuple[int, int, int, int]  # batch, frames, height, width after patching


def embed(transformer: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor,
          encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None = None) -> WanTokens:  # fmt: skip
    """The forward up to its block loop: `hidden_states` [B, C, F, H, W] -> tokens and conditions."""
    batch_size, num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = transformer.config.patch_size
    grid = (batch_size, num_frames // p_t, height // p_h, width // p_w)

    rotary_emb = transformer.rope(hidden_states)
    hidden_states = transformer.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2).contiguous()  # [B, S, D]
    if timestep.ndim == 2:  # [B, S] per-token timesteps (Wan 2.2 TI2V)
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    else:
        ts_seq_len = None
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = transformer.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len
    )
    timestep_proj = timestep_proj.unflatten(2, (6, -1)) if ts_seq_len is not None else timestep_proj.unflatten(1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)
    return WanTokens(hidden_states, encoder_hidden_states, timestep_proj, temb, rotary_emb, grid)


def project_out(transformer: nn.Module, hidden_states: torch.Tensor, tokens: WanTokens) -> torch.Tensor:
    """The forward after its block loop: the blocks' output [B, S, D] -> noise prediction [B, C, F, H, W]."""
    batch_size, post_patch_num_frames, post_patch_height, post_patch_width = tokens.grid
    p_t, p_h, p_w = transformer.config.patch_size
    temb = tokens.temb
    if temb.ndim == 3:
        shift, scale = (transformer.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (transformer.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.to(hidden_states.device), scale.to(hidden_states.device)
    hidden_states = (transformer.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
    hidden_states = transformer.proj_out(hidden_states)
    hidden_states = hidden_states.reshape(
        batch_size, post_patch_num_frames, post_patch_height, post_patch_width, p_t, p_h, p_w, -1
    )
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)


class WanSections(nn.Module):
    """Wan's DenoiserSections: the functions above, bound to one transformer (no weight copy). `media`:
    how a request's image enters the step, as the plain step takes it (fvgraph/loops/steps.py's
    ConcatCondition for I2V, GivenFrames for TI2V: the model input, the timestep and any image
    tokens); its inputs are conditions of both CFG branches."""

    teacache_signal = "timestep"  # TeaCache4Wan2.1 reads the timestep embedding: planned before the run

    def __init__(self, transformer: nn.Module, media: Callable | None = None):
        super().__init__()
        self.transformer = transformer
        self.media = media

    def conditions(self, inputs: Mapping[str, torch.Tensor], branch: int) -> dict[str, torch.Tensor]:
        media = () if self.media is None else self.media.inputs
        return {"encoder_hidden_states": inputs[TEXTS[branch]], **{name: inputs[name] for name in media if inputs.get(name) is not None}}

    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              **media: torch.Tensor) -> WanTokens:  # fmt: skip
        side = {}
        if self.media is not None:  # the model input and the image tokens, as the plain step makes them
            hidden_states, timestep, side = self.media(hidden_states, timestep, **media)
        return embed(self.transformer, hidden_states, timestep, encoder_hidden_states, side.get("encoder_hidden_states_image"))

    def first_block(self, hidden: torch.Tensor, tokens: WanTokens) -> torch.Tensor:
        return self.transformer.blocks[0](hidden, tokens.encoder_hidden_states, tokens.timestep_proj, tokens.rotary_emb)

    def remaining_blocks(self, hidden: torch.Tensor, tokens: WanTokens) -> torch.Tensor:
        for block in list(self.transformer.blocks)[1:]:
            hidden = block(hidden, tokens.encoder_hidden_states, tokens.timestep_proj, tokens.rotary_emb)
        return hidden

    def stream(self, hidden: torch.Tensor, tokens: WanTokens) -> torch.Tensor:
        return hidden  # the blocks carry the video tokens only (text is a condition of each block)

    def project_out(self, stream: torch.Tensor, tokens: WanTokens) -> torch.Tensor:
        return project_out(self.transformer, stream, tokens)

    def token_shape(self, latents: torch.Tensor, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        config = self.transformer.config  # Wan's conditions join channels or the text, not the video tokens
        return 1, _tokens(config, latents), config.num_attention_heads * config.attention_head_dim

    def hidden_shape(self, latents: torch.Tensor, text_tokens: int, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        return self.token_shape(latents)

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        return wan_attention_shape(self.transformer, inputs)

    @property
    def token_dtype(self) -> torch.dtype:
        # the patch embedding's: `transformer.dtype` may name a parameter kept in fp32 instead
        return self.transformer.patch_embedding.weight.dtype


def wan_attention_shape(transformer: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
    """(tokens, head_dim, dtype) of the denoiser's self-attention for a step's inputs: what the SDPA
    backend choice is made for (fvgraph.kernels.attention)."""
    return _tokens(transformer.config, inputs["latents"]), transformer.config.attention_head_dim, inputs["prompt_embeds"].dtype


def _tokens(config, latents: torch.Tensor) -> int:
    _, _, frames, height, width = latents.shape
    p_t, p_h, p_w = config.patch_size
    return (frames // p_t) * (height // p_h) * (width // p_w)
