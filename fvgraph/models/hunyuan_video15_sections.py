"""HunyuanVideo-1.5's denoiser sections (fvgraph/contract/denoiser_sections.py): the forward
(fvgraph/models/hunyuan_video15_forward.py, diffusers' `HunyuanVideo15Transformer3DModel.forward` with
its data-dependent token order made static) cut around its block loop, which step caching runs on.

- `embed`: what the step does before the call (the latents with the condition latents and mask on the
  channels, zeros for text-to-video, in the denoiser's dtype) and the forward's prologue: RoPE, the
  timestep embedding, the patches, the three conditioning streams (the token refiner over the Qwen
  tokens, ByT5's projection, the image tokens: SigLIP's for image-to-video, masked zeros for
  text-to-video), each with its type embedding, valid tokens first;
- the blocks: the dual-stream blocks, which pass the conditioning tokens and the latents' tokens;
  the sections carry them as one tensor, conditioning first ([B, N + S, D]: slicing and concatenating
  copy values exactly), and the latents' tokens are the `stream` the output section reads and
  caching keeps (the blocks' `hidden_states`, as diffusers' cache hooks see them);
- `project_out`: the output norm and projection, unpatchified.

Each line is the forward's, in its order, so the sections equal it bit for bit in eager.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from fvgraph.models.hunyuan_video15_forward import VISION_TOKENS, attention_tokens, denoiser_input, prologue

# Per CFG branch (cond, uncond): the step inputs holding its text's four tensors (the loop's names).
TEXTS = tuple((slot, f"{slot}_mask", f"{slot}_2", f"{slot}_mask_2") for slot in ("prompt_embeds", "negative_prompt_embeds"))
ARGUMENTS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2")
IMAGE_INPUTS = ("condition", "image_embeds")  # image-to-video's, the same in both branches


class HunyuanTokens(NamedTuple):
    hidden_states: torch.Tensor  # [B, N + S, D] the conditioning tokens, then the latents' tokens: the first block's input
    condition_tokens: int  # N
    temb: torch.Tensor  # [B, D]
    mask: torch.Tensor  # [B, N] bool: which conditioning tokens the attention reads
    rotary_emb: tuple[torch.Tensor, torch.Tensor]
    grid: tuple[int, int, int, int]  # batch, frames, height, width of the latents


class HunyuanVideo15Sections(nn.Module):
    """HunyuanVideo-1.5's DenoiserSections, bound to one transformer (no weight copy). `glyph_tokens`:
    ByT5's padded length (the loop's), `image_tokens`: the image stream's (SigLIP's token count on an
    image-to-video card), for the blocks' state shape."""

    teacache_signal = "modulated_input"  # TeaCache's HunyuanVideo forward reads the first block's modulated input

    def __init__(self, transformer: nn.Module, glyph_tokens: int, image_tokens: int = VISION_TOKENS):
        super().__init__()
        self.transformer = transformer
        self.glyph_tokens = glyph_tokens
        self.image_tokens = image_tokens

    def conditions(self, inputs: Mapping[str, torch.Tensor], branch: int) -> dict[str, torch.Tensor]:
        texts = {argument: inputs[name] for argument, name in zip(ARGUMENTS, TEXTS[branch])}
        return {**texts, **{name: inputs[name] for name in IMAGE_INPUTS if inputs.get(name) is not None}}

    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              encoder_attention_mask: torch.Tensor, encoder_hidden_states_2: torch.Tensor,
              encoder_attention_mask_2: torch.Tensor, condition: torch.Tensor | None = None,
              image_embeds: torch.Tensor | None = None) -> HunyuanTokens:  # fmt: skip
        """The step's model input and the forward up to its block loop: latents [B, C, F, h, w] and the
        timestep [B] (sigma x 1000) -> tokens and conditions. Image-to-video: `condition` [B, C + 1, F, h, w]
        the image's latents and mask, `image_embeds` SigLIP's tokens."""
        model = self.transformer
        dtype = encoder_hidden_states.dtype
        batch, _, frames, height, width = hidden_states.shape
        hidden_states = denoiser_input(hidden_states, condition, dtype)  # the step's, as the plain step makes it
        timestep = timestep.to(dtype)
        hidden_states, temb, rotary, tokens, mask = prologue(model, hidden_states, timestep, encoder_hidden_states,
                                                             encoder_attention_mask, encoder_hidden_states_2,
                                                             encoder_attention_mask_2, image_embeds)  # fmt: skip
        grid = (batch, frames, height, width)
        return HunyuanTokens(torch.cat([tokens, hidden_states], dim=1), tokens.shape[1], temb, mask, rotary, grid)

    def first_block(self, hidden: torch.Tensor, tokens: HunyuanTokens) -> torch.Tensor:
        return self._run(self.transformer.transformer_blocks[:1], hidden, tokens)

    def remaining_blocks(self, hidden: torch.Tensor, tokens: HunyuanTokens) -> torch.Tensor:
        return self._run(self.transformer.transformer_blocks[1:], hidden, tokens)

    def stream(self, hidden: torch.Tensor, tokens: HunyuanTokens) -> torch.Tensor:
        return hidden[:, tokens.condition_tokens :]

    def modulated_input(self, tokens: HunyuanTokens) -> torch.Tensor:
        """[B, S, D]: the first block's `norm1` of the latents' tokens entering it, modulated by `temb`."""
        modulated, *_ = self.transformer.transformer_blocks[0].norm1(self.stream(tokens.hidden_states, tokens), emb=tokens.temb)
        return modulated

    def project_out(self, stream: torch.Tensor, tokens: HunyuanTokens) -> torch.Tensor:
        """The forward after its block loop: the latents' tokens -> [B, C_out, F, h, w]."""
        model = self.transformer
        batch, frames, height, width = tokens.grid
        p_t, p = model.config.patch_size_t, model.config.patch_size
        hidden_states = model.proj_out(model.norm_out(stream, tokens.temb))
        hidden_states = hidden_states.reshape(batch, frames // p_t, height // p, width // p, -1, p_t, p, p)
        hidden_states = hidden_states.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def token_shape(self, latents: torch.Tensor, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        _, _, frames, height, width = latents.shape
        config = self.transformer.config
        patches = (frames // config.patch_size_t) * (height // config.patch_size) * (width // config.patch_size)
        return 1, patches, int(config.num_attention_heads * config.attention_head_dim)

    def hidden_shape(self, latents: torch.Tensor, text_tokens: int, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        _, patches, dim = self.token_shape(latents)
        return 1, self.image_tokens + self.glyph_tokens + text_tokens + patches, dim

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        """(tokens, head_dim, dtype) of the blocks' joint attention (fvgraph.kernels.attention)."""
        text = inputs["prompt_embeds"]
        tokens = attention_tokens(self.transformer, inputs["latents"], text.shape[1], self.glyph_tokens, self.image_tokens)
        return tokens, int(self.transformer.config.attention_head_dim), text.dtype

    @property
    def token_dtype(self) -> torch.dtype:
        return self.transformer.x_embedder.proj.weight.dtype  # the patches': what the blocks' tokens are in

    @staticmethod
    def _run(blocks, hidden: torch.Tensor, tokens: HunyuanTokens) -> torch.Tensor:
        condition, latents = hidden[:, : tokens.condition_tokens], hidden[:, tokens.condition_tokens :]
        for block in blocks:
            latents, condition = block(latents, condition, tokens.temb, tokens.mask, tokens.rotary_emb)
        return torch.cat([condition, latents], dim=1)
