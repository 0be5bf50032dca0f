"""HunyuanVideo15Transformer3DModel's forward for text- and image-to-video, as one traceable tensor function.

diffusers' forward decides on the data twice: `torch.all(image_embeds == 0)` picks the text-to-video
branch in Python, and the conditioning tokens are put in order with boolean indexing per batch row
(valid image, valid ByT5, valid Qwen tokens, then the invalid ones, the invalid text tokens zeroed), a
shape that depends on the masks. Neither traces with fullgraph=True. Here the branch is fixed by the
call (no `image_embeds`, text-to-video: the image tokens are masked out, their embeddings the projected
zeros times 0.0; SigLIP's `image_embeds`, image-to-video: every image token valid) and the order is a stable sort of each token's group, so the same tokens land in the same
places, gathered, with every shape static. The model's own submodules run in its own order, so the
result equals its forward (tests/test_hunyuan_video15.py compares them bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

VISION_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: the image tokens every call carries


class StreamsBlock(nn.Module):
    """A dual-stream block returning (text stream, image stream), the order parity taps read a block's
    output in (fvgraph/loops/taps.py: the image stream last; the last block's text stream is dead code)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, tokens = self.block(*args)
        return tokens, hidden_states


class HunyuanVideo15TextToVideo(nn.Module):
    """`transformer` called as HunyuanVideo15Pipeline calls it for text-to-video (zero image embeddings),
    or, given `image_embeds`, as HunyuanVideo15ImageToVideoPipeline calls it (SigLIP's tokens, all valid);
    every argument has the batch dimension, so the CFG-fusion pass can concatenate two branches' calls.
    `blocks` are the transformer's own blocks, in the order taps read."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.transformer = transformer
        self.blocks = nn.ModuleList(StreamsBlock(block) for block in transformer.transformer_blocks)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor, encoder_hidden_states_2: torch.Tensor,
                encoder_attention_mask_2: torch.Tensor, image_embeds: torch.Tensor | None = None,
                return_dict: bool = False) -> tuple[torch.Tensor]:  # fmt: skip
        model = self.transformer
        batch, _, frames, height, width = hidden_states.shape
        p_t, p = model.config.patch_size_t, model.config.patch_size
        hidden_states, temb, rotary, tokens, mask = prologue(model, hidden_states, timestep, encoder_hidden_states,
                                                             encoder_attention_mask, encoder_hidden_states_2,
                                                             encoder_attention_mask_2, image_embeds)  # fmt: skip
        # 4. the dual-stream blocks
        for block in self.blocks:
            tokens, hidden_states = block(hidden_states, tokens, temb, mask, rotary)
        # 5. the output projection, unpatchified
        hidden_states = model.proj_out(model.norm_out(hidden_states, temb))
        hidden_states = hidden_states.reshape(batch, frames // p_t, height // p, width // p, -1, p_t, p, p)
        hidden_states = hidden_states.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return (hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def denoiser_input(latents: torch.Tensor, condition: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The denoiser's input [B, 2 C + 1, F, h, w]: the latents, then the condition latents and mask on
    the channels (image-to-video's `condition`; zeros for text-to-video, as the pipeline's), in `dtype`."""
    if condition is None:
        batch, _, frames, h, w = latents.shape
        condition = torch.cat([torch.zeros_like(latents), latents.new_zeros(batch, 1, frames, h, w)], dim=1)
    return torch.cat([latents, condition], dim=1).to(dtype)


def prologue(model: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
             encoder_attention_mask: torch.Tensor, encoder_hidden_states_2: torch.Tensor, encoder_attention_mask_2: torch.Tensor,
             image_embeds: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The forward before its block loop: (the latents' patches, temb, RoPE, the conditioning tokens, their mask)."""
    # 1. RoPE, the timestep embedding and the latents' patches
    rotary = model.rope(hidden_states)
    temb = model.time_embed(timestep)
    hidden_states = model.x_embedder(hidden_states)
    # 2. the three conditioning streams, each with its type embedding
    text = model.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
    text = text + model.cond_type_embed(torch.zeros_like(text[:, :, 0], dtype=torch.long))
    glyph = model.context_embedder_2(encoder_hidden_states_2)
    glyph = glyph + model.cond_type_embed(torch.ones_like(glyph[:, :, 0], dtype=torch.long))
    image, image_mask = _image_tokens(model, image_embeds, text)
    image = image + model.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))
    # 3. valid tokens first (image, ByT5, Qwen), then the invalid ones (the text's zeroed), each group in order
    tokens, mask = _valid_first(image, image_mask, glyph, encoder_attention_mask_2.bool(), text, encoder_attention_mask.bool())
    return hidden_states, temb, rotary, tokens, mask


def _image_tokens(model: nn.Module, image_embeds: torch.Tensor | None, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The image stream and its mask: SigLIP's embeddings projected, every token valid (image-to-video);
    without them, the projected zeros times 0.0, every token masked (text-to-video, as the pipeline's zeros)."""
    batch = text.shape[0]
    if image_embeds is not None:
        image = model.image_embedder(image_embeds)
        return image, torch.ones(batch, image.shape[1], dtype=torch.bool, device=text.device)
    image = model.image_embedder(text.new_zeros(batch, VISION_TOKENS, model.config.image_embed_dim)) * 0.0
    return image, torch.zeros(batch, VISION_TOKENS, dtype=torch.bool, device=text.device)


def _valid_first(image: torch.Tensor, image_mask: torch.Tensor, glyph: torch.Tensor, glyph_mask: torch.Tensor,
                 text: torch.Tensor, text_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """[B, N, D] tokens and [B, N] bool mask in diffusers' order: [valid image, valid ByT5, valid Qwen,
    invalid image, invalid ByT5 (zeroed), invalid Qwen (zeroed)]. A stable sort on each token's group
    (0-2 valid, 3-5 invalid) keeps the order within a group, as boolean indexing does."""
    glyph = torch.where(glyph_mask.unsqueeze(-1), glyph, torch.zeros_like(glyph))
    text = torch.where(text_mask.unsqueeze(-1), text, torch.zeros_like(text))
    tokens = torch.cat([image, glyph, text], dim=1)
    mask = torch.cat([image_mask, glyph_mask, text_mask], dim=1)
    stream = torch.cat([torch.full_like(m, i, dtype=torch.long) for i, m in enumerate((image_mask, glyph_mask, text_mask))], dim=1)
    group = torch.where(mask, stream, stream + 3)
    order = torch.sort(group, dim=1, stable=True).indices
    tokens = torch.gather(tokens, 1, order.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
    return tokens, torch.gather(mask, 1, order)


def attention_tokens(transformer: nn.Module, latents: torch.Tensor, text_tokens: int, glyph_tokens: int,
                     image_tokens: int = VISION_TOKENS) -> int:  # fmt: skip
    """How many tokens the blocks' joint attention runs over: the latents' patches and every conditioning token."""
    _, _, frames, height, width = latents.shape
    p_t, p = transformer.config.patch_size_t, transformer.config.patch_size
    return (frames // p_t) * (height // p) * (width // p) + image_tokens + glyph_tokens + text_tokens
