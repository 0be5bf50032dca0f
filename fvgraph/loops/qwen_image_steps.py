"""Step functions of the Qwen-Image loop (fvgraph/loops/qwen_image_loop.py), pure tensor functions like steps.py's.

The latents are a one-frame video [1, C, 1, h, w] float32 (fvgraph/loops/image_parts.py). Inside the
step they are packed 2x2 into tokens with diffusers' own QwenImagePipeline helpers, the transformer
gets the image shape it builds its rotary positions from (static in the trace) and each text's
padding mask, and the prediction is unpacked before the Euler update: a permutation, which commutes
exactly with the elementwise update. The true-CFG combine and its norm rescaling run on the packed
prediction, where QwenImagePipeline takes the norm (over each token's packed channels).
"""

from __future__ import annotations

import torch
from diffusers import QwenImagePipeline
from torch import nn

from fvgraph.contract.denoise_update import guided, sampler_update
from fvgraph.contract.markers import mark_request_constant
from fvgraph.loops.image_steps import ImageDenoiseStep
from fvgraph.loops.samplers import FlowEulerSampler
from fvgraph.loops.taps import TapPoints


class QwenTextEncodeStep(nn.Module):
    """Template-wrapped token ids -> Qwen2.5-VL's last hidden state [n, T, D], as
    QwenImagePipeline._get_qwen_prompt_embeds reads it. Which rows' tokens to keep (the valid ones
    after the template's system prompt) is data, so the loop selects them on the host."""

    def __init__(self, text_encoder: nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return {"embeds": out.hidden_states[-1]}


class QwenImageDenoiser(nn.Module):
    """QwenImageTransformer2DModel on one-frame latents [B, C, 1, h, w]: packs them and passes the
    image shape; returns the packed prediction [B, h/2 * w/2, 4C]. Every tensor argument has the
    batch dimension, so the CFG-fusion pass can concatenate the two branches' calls."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor, return_dict: bool = False, condition: torch.Tensor | None = None,
                **adapter_rows: torch.Tensor):  # fmt: skip
        """`condition` [B, C, 1, hc, wc]: an edited image's latents (Qwen-Image-Edit), packed and joined after
        the latents' tokens with its own entry in the image shapes (the rotary positions' second frame), as
        QwenImageEditPipeline joins them; the prediction is read from the latents' tokens only."""
        batch, channels, _, h, w = hidden_states.shape
        packed = QwenImagePipeline._pack_latents(hidden_states[:, :, 0], batch, channels, h, w)
        tokens, shapes = packed.shape[1], [(1, h // 2, w // 2)]
        if condition is not None:
            _, _, _, hc, wc = condition.shape
            joined = QwenImagePipeline._pack_latents(condition[:, :, 0].to(packed.dtype), batch, channels, hc, wc)
            packed, shapes = torch.cat([packed, joined], dim=1), [*shapes, (1, hc // 2, wc // 2)]
        out = self.transformer(hidden_states=packed, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                               encoder_hidden_states_mask=encoder_hidden_states_mask, img_shapes=[shapes] * batch,
                               return_dict=False, **adapter_rows)[0]  # fmt: skip
        return (out[:, :tokens],)


class QwenImageDenoiseStep(ImageDenoiseStep):
    """One Qwen-Image denoise step, as QwenImagePipeline's loop body: the cond branch, the true-CFG
    uncond branch (when `cfg`), the combine `uncond + true_cfg_scale * (cond - uncond)` rescaled to the
    cond prediction's per-token norm, and the Euler update."""

    def __init__(self, transformer: nn.Module, sampler: FlowEulerSampler, cfg: bool, vae_spatial: int,
                 tap_points: TapPoints | None = None):  # fmt: skip
        super().__init__(QwenImageDenoiser(transformer), sampler, cfg, vae_spatial, tap_points)

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, 1, h, w] float32
        timestep: torch.Tensor,  # [B] the scheduler's timesteps (0..1000)
        coeffs: torch.Tensor,  # [B, 2] this step's Euler row
        prompt_embeds: torch.Tensor,  # [B, L, D] Qwen2.5-VL's hidden states, zero past each text's tokens
        prompt_embeds_mask: torch.Tensor,  # [B, L] int64, 1 where a token is attended to
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        guidance_scale: torch.Tensor | None = None,  # [B] true_cfg_scale, when cfg
        lora_index: torch.Tensor | None = None,  # [B, K] int64 each row's adapter slots, on an engine with them
        lora_scale: torch.Tensor | None = None,  # [B, K] float32 their scales (0 where unused)
        condition: torch.Tensor | None = None,  # [B, C, 1, hc, wc] an edit's image latents (Qwen-Image-Edit)
        **carry: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        dtype = prompt_embeds.dtype
        model_input = latents.to(dtype)  # QwenImagePipeline's latents are in the text's dtype
        t = timestep.to(dtype) / 1000  # t.expand(B).to(latents.dtype), passed as timestep / 1000
        side = self.adapter_rows(lora_index, lora_scale)
        if condition is not None:  # the same image in both branches
            side["condition"] = mark_request_constant(condition)
        taps = {}
        cond = dict(hidden_states=model_input, timestep=t, encoder_hidden_states=mark_request_constant(prompt_embeds),
                    encoder_hidden_states_mask=mark_request_constant(prompt_embeds_mask), **side)  # fmt: skip
        uncond = None if not self.cfg else dict(
            hidden_states=model_input, timestep=t, encoder_hidden_states=mark_request_constant(negative_prompt_embeds),
            encoder_hidden_states_mask=mark_request_constant(negative_prompt_embeds_mask), **side)  # fmt: skip
        noise, uncond = self.branches(cond, uncond)
        taps["tap.noise.cond"] = noise
        if self.cfg:
            combined = guided(noise, uncond, guidance_scale)
            cond_norm = torch.norm(noise, dim=-1, keepdim=True)
            noise_norm = torch.norm(combined, dim=-1, keepdim=True)
            noise = combined * (cond_norm / noise_norm)
            taps["tap.noise.uncond"], taps["tap.noise"] = uncond, noise
        _, _, _, h, w = latents.shape
        noise = QwenImagePipeline._unpack_latents(noise, h * self.vae_spatial, w * self.vae_spatial, self.vae_spatial)
        return self.with_taps(sampler_update(self.sampler, latents, noise, carry, coeffs), taps)
