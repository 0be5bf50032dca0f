"""Step functions of the FLUX loop (fvgraph/loops/flux_loop.py), pure tensor functions like steps.py's.

The loop keeps an image's latents as a one-frame video, [1, C, 1, h, w] float32, so the runtime's
latents, padding and finite checks are the video loops' own. The 2x2 packing into tokens, the
position ids and the unpacking of the prediction happen inside the step, with diffusers' own
FluxPipeline helpers: the shapes they need are static in the trace, and each is a permutation, which
commutes exactly with the Euler update (the result equals stepping the packed latents, bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.contract.denoise_update import guided, sampler_update
from fvgraph.contract.markers import mark_request_constant
from fvgraph.loops.image_steps import ImageDenoiseStep
from fvgraph.loops.samplers import FlowEulerSampler
from fvgraph.loops.taps import TapPoints
from fvgraph.models.flux_sections import condition_tokens, pack_with_condition, scheduler_time, unpack


class FluxTextEncodeStep(nn.Module):
    """CLIP's pooled output and T5's sequence, as FluxPipeline.encode_prompt takes them (no mask, no zeroing)."""

    def __init__(self, text_encoder: nn.Module, text_encoder_2: nn.Module):
        super().__init__()
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2

    def forward(self, input_ids: torch.Tensor, input_ids_2: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = self.text_encoder(input_ids, output_hidden_states=False).pooler_output
        embeds = self.text_encoder_2(input_ids_2, output_hidden_states=False)[0]
        return {"pooled": pooled.to(self.text_encoder.dtype), "embeds": embeds}


class FluxDenoiser(nn.Module):
    """FluxTransformer2DModel on one-frame latents [B, C, 1, h, w]: packs them, adds the text and image
    position ids (the same for every row of a shape) and unpacks the prediction. Every argument has the
    batch dimension, so the CFG-fusion pass can concatenate the two branches' calls."""

    def __init__(self, transformer: nn.Module, vae_spatial: int):
        super().__init__()
        self.transformer = transformer
        self.vae_spatial = vae_spatial

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, guidance: torch.Tensor | None = None, return_dict: bool = False,
                condition: torch.Tensor | None = None, **adapter_rows: torch.Tensor):  # fmt: skip
        """`condition` [B, C, 1, hc, wc]: an edited image's latents (FLUX.1 Kontext), joined after the
        latents' tokens with position ids whose first axis is 1, as FluxKontextPipeline joins them; the
        prediction is read from the latents' tokens only."""
        packed, img_ids, txt_ids = pack_with_condition(hidden_states, encoder_hidden_states, condition)
        tokens = packed.shape[1] - condition_tokens(condition)
        out = self.transformer(hidden_states=packed, timestep=timestep, guidance=guidance, pooled_projections=pooled_projections,
                               encoder_hidden_states=encoder_hidden_states, txt_ids=txt_ids, img_ids=img_ids,
                               return_dict=False, **adapter_rows)[0]  # fmt: skip
        return (unpack(out[:, :tokens], tuple(hidden_states.shape[-2:]), self.vae_spatial),)


class FluxDenoiseStep(ImageDenoiseStep):
    """One FLUX denoise step: the cond branch, the true-CFG uncond branch (when `cfg`), the combine
    `uncond + true_cfg_scale * (cond - uncond)` and the Euler update, as FluxPipeline's loop body."""

    def __init__(self, transformer: nn.Module, sampler: FlowEulerSampler, cfg: bool, vae_spatial: int,
                 tap_points: TapPoints | None = None):  # fmt: skip
        super().__init__(FluxDenoiser(transformer, vae_spatial), sampler, cfg, vae_spatial, tap_points)

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, 1, h, w] float32
        timestep: torch.Tensor,  # [B] the scheduler's timesteps (0..1000)
        coeffs: torch.Tensor,  # [B, 2] this step's Euler row
        prompt_embeds: torch.Tensor,  # [B, L, D] T5
        pooled_prompt_embeds: torch.Tensor,  # [B, P] CLIP pooled
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
        guidance_scale: torch.Tensor | None = None,  # [B] true_cfg_scale, when cfg
        guidance: torch.Tensor | None = None,  # [B] float32 the embedded guidance, where the weights take it
        lora_index: torch.Tensor | None = None,  # [B, K] int64 each row's adapter slots, on an engine with them
        lora_scale: torch.Tensor | None = None,  # [B, K] float32 their scales (0 where unused)
        condition: torch.Tensor | None = None,  # [B, C, 1, hc, wc] an edit's image latents (FLUX.1 Kontext)
        **carry: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        dtype = prompt_embeds.dtype
        model_input = latents.to(dtype)
        t = scheduler_time(timestep, dtype)
        side = self.adapter_rows(lora_index, lora_scale)
        if guidance is not None:
            side["guidance"] = mark_request_constant(guidance)
        if condition is not None:  # the same image in both branches
            side["condition"] = mark_request_constant(condition)
        taps = {}
        cond = dict(hidden_states=model_input, timestep=t, encoder_hidden_states=mark_request_constant(prompt_embeds),
                    pooled_projections=mark_request_constant(pooled_prompt_embeds), **side)  # fmt: skip
        uncond = None if not self.cfg else dict(
            hidden_states=model_input, timestep=t, encoder_hidden_states=mark_request_constant(negative_prompt_embeds),
            pooled_projections=mark_request_constant(negative_pooled_prompt_embeds), **side)  # fmt: skip
        noise, uncond = self.branches(cond, uncond)
        taps["tap.noise.cond"] = noise
        if self.cfg:
            noise = guided(noise, uncond, guidance_scale)
            taps["tap.noise.uncond"], taps["tap.noise"] = uncond, noise
        return self.with_taps(sampler_update(self.sampler, latents, noise, carry, coeffs), taps)


class ImageVaeDecodeStep(nn.Module):
    """One-frame latents -> image in [0, 1] as a one-frame video [B, 3, 1, H, W]: FluxPipeline's
    `latents / scaling_factor + shift_factor`, decode and denormalize."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling = float(vae.config.scaling_factor)
        self.shift = float(vae.config.shift_factor or 0.0)

    def forward(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        image = self.vae.decode(self.vae_latents(latents), return_dict=False)[0]
        return {"video": self.postprocess(image)}

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """What the VAE decodes: the one frame, unscaled (a tiled decode runs this per tile)."""
        return latents[:, :, 0].to(self.vae.dtype) / self.scaling + self.shift

    @staticmethod
    def postprocess(image: torch.Tensor) -> torch.Tensor:
        """The VAE's image in [-1, 1] -> a one-frame video in [0, 1]."""
        return (image / 2 + 0.5).clamp(0, 1).unsqueeze(2)
