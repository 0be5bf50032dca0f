"""Step functions of Wan's loops, each a pure tensor function; the media parts a denoise step is built
with (`ConcatCondition` for I2V, `GivenFrames` for TI2V) say how a request's image enters it.

A step is an nn.Module whose forward takes only tensors (per-request scalars as [B] tensors) and
returns a dict of tensors: no `.item()`, no branch on data, so each traces with fullgraph=True and one
compiled graph serves every request at every step. Which branches run (CFG or not) and which sampler
updates the latents are fixed at construction, never decided per call.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from fvgraph.contract.denoise_update import guided, sampler_update
from fvgraph.contract.cfg_branches import call_branches
from fvgraph.contract.markers import mark_request_constant
from fvgraph.models.wan_sections import wan_attention_shape
from fvgraph.loops.taps import TapPoints
from fvgraph.loops.samplers import FewStepSampler, FlowEulerSampler, UniPCSampler


class TextEncodeStep(nn.Module):
    """Token ids -> encoder hidden states, zeroed past each sequence's length (as Wan's pipeline pads)."""

    def __init__(self, text_encoder: nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.text_encoder(input_ids, attention_mask).last_hidden_state
        keep = attention_mask.gt(0).unsqueeze(-1)
        return {"embeds": torch.where(keep, hidden, torch.zeros_like(hidden))}


class DenoiseStep(nn.Module):
    """One whole denoise step: the model input (with the request's media, where the loop has a media
    part), the cond branch, the uncond branch (when `cfg`), the guidance combine, the sampler update."""

    def __init__(self, transformer: nn.Module, sampler: FlowEulerSampler | FewStepSampler | UniPCSampler, cfg: bool,
                 tap_points: TapPoints | None = None, media: StepMedia | None = None):  # fmt: skip
        super().__init__()
        self.transformer = transformer
        self.sampler = sampler
        self.cfg = cfg
        # The tap variant (parity runs only) also returns intermediate tensors as "tap.*" outputs.
        self.tap_points = tap_points
        self.media = media  # how a request's image enters the denoiser (ConcatCondition, GivenFrames), or None
        # CFG-parallel (fvgraph/parallel/cfg_split.py): this rank runs one branch and gathers the other.
        self.cfg_split = None
        self.fuse_branches = False  # CFG fusion (passes/cfg_fusion.py) sets it while the step is traced

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, L, D]
        coeffs: torch.Tensor,  # [B, num_coeffs] this step's sampler row
        negative_prompt_embeds: torch.Tensor | None = None,  # [B, L, D] when cfg
        guidance_scale: torch.Tensor | None = None,  # [B] when cfg
        **inputs: torch.Tensor,  # each read by the part that declares it: below
    ) -> dict[str, torch.Tensor]:
        """`inputs`: the sampler's history (carry_0 .. carry_{n-1}, each like latents) and, for a sampler
        that re-noises, this step's draw (fresh_noise); on an engine with adapter slots each row's slots
        and scales (lora_index [B, K] int64, lora_scale [B, K]: fvgraph/adapters/slots.py); the media
        part's (`media.inputs`)."""
        taps = {}
        # 1. the model input (with the request's media) and what each branch's call takes besides its text
        model_input, side = latents, {}
        if self.media is not None:
            model_input, timestep, side = self.media(latents, timestep, **{n: inputs[n] for n in self.media.inputs if n in inputs})
        model_input = model_input.to(prompt_embeds.dtype)
        if "lora_index" in inputs:  # arguments of each branch's call: fused and hoisted like the text
            side.update(lora_index=mark_request_constant(inputs["lora_index"]), lora_scale=mark_request_constant(inputs["lora_scale"]))
        if self.cfg and self.cfg_split is not None:  # one branch here, the other on the CFG peer rank
            noise, noise_uncond = self.cfg_split.both_branches(
                lambda branch, embeds: self._denoise({branch: embeds}, model_input, timestep, side)[branch],
                prompt_embeds, negative_prompt_embeds,
            )  # fmt: skip
        else:  # 2. the conditional branch and the unconditional one (when cfg), fused while traced so
            texts = {"cond": prompt_embeds, **({"uncond": negative_prompt_embeds} if self.cfg else {})}
            noises = self._denoise(texts, model_input, timestep, side)
            noise, noise_uncond = noises["cond"], noises.get("uncond")
        taps["tap.noise.cond"] = noise
        # 3. the guidance combine
        if self.cfg:
            noise = guided(noise, noise_uncond, guidance_scale)
            taps["tap.noise.uncond"], taps["tap.noise"] = noise_uncond, noise
        # 4. the sampler update, with this request's coefficients and history
        out = sampler_update(self.sampler, latents, noise, inputs, coeffs, inputs.get("fresh_noise"))
        if self.tap_points is not None:
            out.update(taps)
            out.update(self.tap_points.drain())  # block outputs (eager; traced graphs get them from the tap pass)
        return out

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        """(tokens, head_dim, dtype) of the denoiser's self-attention (fvgraph.kernels.attention)."""
        return wan_attention_shape(self.transformer, inputs)

    def _denoise(self, texts: dict[str, torch.Tensor], hidden_states, timestep, extra: dict) -> dict[str, torch.Tensor]:
        """{branch: noise} for each branch's text, each call marked as a CFG branch (markers vanish in
        eager); fused into one call while the step is traced with CFG fusion (contract/cfg_branches.py)."""
        branches = {
            branch: dict(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=mark_request_constant(text), **extra)
            for branch, text in texts.items()
        }  # fmt: skip
        outputs = call_branches("transformer", self._transformer, branches, self.fuse_branches)
        return {branch: out[0] for branch, out in outputs.items()}

    def _transformer(self, **inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.transformer(**inputs, return_dict=False)[0],)


def masked_frames(latents: torch.Tensor, timestep: torch.Tensor, first_frame: torch.Tensor, frame_mask: torch.Tensor,
                  patch_size: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The denoiser's input and per-token timesteps [B, S] when some latent frames are given, as
    diffusers' Wan pipelines with `expand_timesteps`: the given frames replace the noise, and their
    tokens see timestep 0 (the mask sampled once per patch, flattened in the patch embedding's order)."""
    model_input = (1 - frame_mask) * first_frame + frame_mask * latents
    p_t, p_h, p_w = patch_size
    token_mask = frame_mask[:, 0, ::p_t, ::p_h, ::p_w].flatten(1)  # [B, S]
    return model_input, token_mask * timestep.unsqueeze(1)


class StepMedia(Protocol):
    """How a request's media enters the denoiser: (model input, timestep, extra call arguments)."""

    inputs: tuple[str, ...]  # the step inputs it reads (request constants)

    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]: ...


class ConcatCondition:
    """Wan 2.1 I2V: the first frame's mask and latents concatenated to the latents' channels, and the
    image's CLIP tokens (where the denoiser takes them) attended beside the text."""

    inputs = ("condition", "image_embeds")

    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor,  # [B, T + C, F, H, W]
                 image_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:  # [B, N, D']  # fmt: skip
        model_input = torch.cat([latents, mark_request_constant(condition)], dim=1)
        side = {} if image_embeds is None else {"encoder_hidden_states_image": mark_request_constant(image_embeds)}
        return model_input, timestep, side


class GivenFrames:
    """Wan 2.2 TI2V: given latent frames replace the noise, their tokens at timestep 0 (masked_frames)."""

    inputs = ("first_frame", "frame_mask")

    def __init__(self, patch_size: tuple[int, int, int]):
        self.patch_size = tuple(patch_size)

    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor, first_frame: torch.Tensor,  # [B, C, 1, H, W]
                 frame_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:  # [B, 1, F, H, W]  # fmt: skip
        model_input, timestep = masked_frames(latents, timestep, mark_request_constant(first_frame),
                                              mark_request_constant(frame_mask), self.patch_size)  # fmt: skip
        return model_input, timestep, {}


class VaeDecodeStep(nn.Module):
    """Normalized latents -> video in [0, 1], [B, 3, F, H, W] (diffusers' denormalize + decode + postprocess)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        z_dim = vae.config.z_dim
        self.register_buffer("latents_mean", torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1))
        self.register_buffer("latents_inv_std", 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1))

    def forward(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        video = self.vae.decode(self.vae_latents(latents), return_dict=False)[0]
        return {"video": self.postprocess(video)}

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """What the VAE decodes: the latents denormalized (a tiled decode runs this per tile)."""
        dtype = self.latents_mean.dtype
        return latents.to(dtype) / self.latents_inv_std.to(dtype) + self.latents_mean

    @staticmethod
    def postprocess(video: torch.Tensor) -> torch.Tensor:
        """The VAE's output in [-1, 1] -> [0, 1], as diffusers' video processor."""
        return (video / 2 + 0.5).clamp(0, 1)
