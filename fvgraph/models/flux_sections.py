"""diffusers' `FluxTransformer2DModel.forward` (diffusers 0.42.1) on one-frame latents, cut around its
block loop: FLUX's denoiser sections (fvgraph/contract/denoiser_sections.py), which step caching runs on.

The loop keeps an image as a one-frame video, [B, C, 1, h, w]. `pack` is what FluxPipeline does before
it calls the transformer (2x2 packing, text and image position ids) and `unpack` what it does after,
with the pipeline's own helpers; `embed` is the forward's first section and `project_out` its last,
each line diffusers' own in diffusers' order. The blocks pass two streams, text and image; the
sections carry them as one tensor, text first ([B, L + S, D]: slicing and concatenating copy values
exactly), and the image tokens are the `stream` that the output section reads and caching keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from diffusers import FluxPipeline
from torch import nn

# Per CFG branch (cond, uncond): the step inputs holding its T5 sequence and its CLIP pooled text.
TEXTS = ("prompt_embeds", "negative_prompt_embeds")
POOLED = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")


def pack(latents: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, C, 1, h, w] latents -> (packed tokens [B, S, 4C], image ids [S, 3], text ids [L, 3]), as
    FluxPipeline prepares them; the ids are the same for every row of a shape."""
    batch, channels, _, h, w = latents.shape
    packed = FluxPipeline._pack_latents(latents[:, :, 0], batch, channels, h, w)
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, h // 2, w // 2, text.device, text.dtype)
    txt_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)
    return packed, img_ids, txt_ids


def pack_with_condition(latents: torch.Tensor, text: torch.Tensor,
                        condition: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`pack`, with an edited image's latents `condition` [B, C, 1, hc, wc] (FLUX.1 Kontext) joined after
    the latents' tokens, position ids' first axis 1, as FluxKontextPipeline joins them."""
    packed, img_ids, txt_ids = pack(latents, text)
    if condition is None:
        return packed, img_ids, txt_ids
    joined, condition_ids, _ = pack(condition.to(packed.dtype), text)
    condition_ids[..., 0] = 1
    return torch.cat([packed, joined], dim=1), torch.cat([img_ids, condition_ids], dim=0), txt_ids


def condition_tokens(condition: torch.Tensor | None) -> int:
    """How many tokens an edited image's latents add to the sequence (none without one)."""
    return 0 if condition is None else (condition.shape[-2] // 2) * (condition.shape[-1] // 2)


def unpack(out: torch.Tensor, latent_hw: tuple[int, int], vae_spatial: int) -> torch.Tensor:
    """The transformer's packed prediction [B, S, 4C] -> [B, C, 1, h, w]."""
    h, w = latent_hw
    return FluxPipeline._unpack_latents(out, h * vae_spatial, w * vae_spatial, vae_spatial).unsqueeze(2)


def scheduler_time(timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FluxPipeline's `t.expand(B).to(latents.dtype) / 1000`: the transformer takes the time in [0, 1]."""
    return timestep.to(dtype) / 1000


class FluxTokens(NamedTuple):
    hidden_states: torch.Tensor  # [B, L + S, D] the text stream, then the image tokens: the first block's input
    text_tokens: int  # L
    temb: torch.Tensor  # [B, D] time (and guidance) plus pooled text
    rotary_emb: tuple[torch.Tensor, torch.Tensor]
    latent_hw: tuple[int, int]  # the latents' h, w (for unpacking)
    latent_tokens: int  # the latents' own tokens: an edit's image tokens follow them (the prediction reads these)


class FluxSections(nn.Module):
    """FLUX's DenoiserSections, bound to one transformer (no weight copy)."""

    teacache_signal = "modulated_input"  # TeaCache4FLUX measures the first block's modulated input at each call

    def __init__(self, transformer: nn.Module, vae_spatial: int):
        super().__init__()
        self.transformer = transformer
        self.vae_spatial = vae_spatial

    def conditions(self, inputs: Mapping[str, torch.Tensor], branch: int) -> dict[str, torch.Tensor]:
        # the embedded guidance (FLUX.1-dev) is the request's, the same for both branches, as is an edit's image
        return {"encoder_hidden_states": inputs[TEXTS[branch]], "pooled_projections": inputs[POOLED[branch]],
                "guidance": inputs.get("guidance"), "condition": inputs.get("condition")}  # fmt: skip

    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              pooled_projections: torch.Tensor, guidance: torch.Tensor | None = None,
              condition: torch.Tensor | None = None) -> FluxTokens:  # fmt: skip
        """FluxPipeline's (or FluxKontextPipeline's, given `condition`) call and the forward up to its
        block loop: latents [B, C, 1, h, w] and the scheduler's timestep [B] -> tokens and conditions.
        An edit's image tokens are part of the blocks' image stream, as diffusers' cache hooks see it."""
        tr = self.transformer
        latent_hw = tuple(hidden_states.shape[-2:])
        packed, img_ids, txt_ids = pack_with_condition(hidden_states, encoder_hidden_states, condition)
        latent_tokens = packed.shape[1] - condition_tokens(condition)
        timestep = scheduler_time(timestep, encoder_hidden_states.dtype)
        hidden_states = tr.x_embedder(packed)
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = tr.time_text_embed(timestep, pooled_projections) if guidance is None else tr.time_text_embed(timestep, guidance, pooled_projections)
        text = tr.context_embedder(encoder_hidden_states)
        rotary_emb = tr.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return FluxTokens(torch.cat([text, hidden_states], dim=1), text.shape[1], temb, rotary_emb, latent_hw, latent_tokens)

    def first_block(self, hidden: torch.Tensor, tokens: FluxTokens) -> torch.Tensor:
        return self._run(self._blocks()[:1], hidden, tokens)

    def remaining_blocks(self, hidden: torch.Tensor, tokens: FluxTokens) -> torch.Tensor:
        return self._run(self._blocks()[1:], hidden, tokens)

    def stream(self, hidden: torch.Tensor, tokens: FluxTokens) -> torch.Tensor:
        return hidden[:, tokens.text_tokens :]

    def modulated_input(self, tokens: FluxTokens) -> torch.Tensor:
        """[B, S, D]: the first block's `norm1` of the image tokens entering it, modulated by `temb`
        (TeaCache4FLUX's `modulated_inp`, the signal its decision reads)."""
        modulated, *_ = self.transformer.transformer_blocks[0].norm1(self.stream(tokens.hidden_states, tokens), emb=tokens.temb)
        return modulated

    def project_out(self, stream: torch.Tensor, tokens: FluxTokens) -> torch.Tensor:
        """The forward after its block loop and the pipeline's unpacking of the latents' own tokens:
        image tokens -> [B, C, 1, h, w]."""
        out = self.transformer.proj_out(self.transformer.norm_out(stream, tokens.temb))
        return unpack(out[:, : tokens.latent_tokens], tokens.latent_hw, self.vae_spatial)

    def token_shape(self, latents: torch.Tensor, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        _, _, _, h, w = latents.shape
        return 1, (h // 2) * (w // 2) + condition_tokens(condition), self._inner_dim()

    def hidden_shape(self, latents: torch.Tensor, text_tokens: int, condition: torch.Tensor | None = None) -> tuple[int, int, int]:
        _, tokens, dim = self.token_shape(latents, condition)
        return 1, text_tokens + tokens, dim

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        """(tokens, head_dim, dtype) of the joint attention: text plus packed image tokens."""
        return packed_attention_shape(self.transformer, inputs)

    @property
    def token_dtype(self) -> torch.dtype:
        return self.transformer.x_embedder.weight.dtype

    def _blocks(self) -> list[nn.Module]:
        # diffusers' cache hooks take the blocks in this order: double-stream, then single-stream
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    @staticmethod
    def _run(blocks: list[nn.Module], hidden: torch.Tensor, tokens: FluxTokens) -> torch.Tensor:
        text, image = hidden[:, : tokens.text_tokens], hidden[:, tokens.text_tokens :]
        for block in blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=tokens.temb,
                                image_rotary_emb=tokens.rotary_emb, joint_attention_kwargs=None)  # fmt: skip
        return torch.cat([text, image], dim=1)

    def _inner_dim(self) -> int:
        config = self.transformer.config
        return int(config.num_attention_heads * config.attention_head_dim)


def packed_attention_shape(transformer: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
    """(tokens, head_dim, dtype) of a 2x2-packing image DiT's joint attention (FLUX, Qwen-Image): the
    text tokens plus the packed image tokens of the step's one-frame latents and, on an edit, of the
    image latents joined after them (`condition`)."""
    _, _, _, h, w = inputs["latents"].shape
    tokens = inputs["prompt_embeds"].shape[1] + (h // 2) * (w // 2) + condition_tokens(inputs.get("condition"))
    return tokens, int(transformer.config.attention_head_dim), inputs["prompt_embeds"].dtype
