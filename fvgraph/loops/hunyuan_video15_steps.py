"""Step functions of the HunyuanVideo-1.5 loop (fvgraph/loops/hunyuan_video15_loop.py), pure tensor functions.

- text encode: Qwen2.5-VL's third-to-last hidden state over the chat-templated tokens, the template's
  prefix dropped, and ByT5 over the quoted text (rows without one come out zero: their mask is zero);
- denoise: the latents with the condition latents and mask concatenated to their channels (zeros for
  text-to-video; the image's for image-to-video, fvgraph/loops/hunyuan_video15_image.py), the
  transformer per CFG branch (fvgraph/models/hunyuan_video15_forward.py), the guidance combine
  uncond + scale * (cond - uncond) (ClassifierFreeGuidance), the Euler update;
- decode: the latents divided by the VAE's scaling factor, decoded, mapped to [0, 1].
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.adapters.slots import slot_store
from fvgraph.contract.cfg_branches import call_branches
from fvgraph.contract.denoise_update import guided, sampler_update
from fvgraph.contract.markers import mark_request_constant
from fvgraph.loops.samplers import FlowEulerSampler
from fvgraph.loops.taps import TapPoints
from fvgraph.models.hunyuan_video15_forward import HunyuanVideo15TextToVideo, attention_tokens, denoiser_input

TEMPLATE_PREFIX = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx: the tokens dropped from the front
HIDDEN_STATE = -3  # the pipeline's num_hidden_layers_to_skip=2: hidden_states[-(2 + 1)]


class HunyuanTextEncodeStep(nn.Module):
    """Token ids of both encoders -> {"embeds": [n, 1000, D], "glyph_embeds": [n, 256, D2]}, as
    HunyuanVideo15Pipeline._get_mllm_prompt_embeds and _get_byt5_prompt_embeds make them."""

    def __init__(self, text_encoder: nn.Module, text_encoder_2: nn.Module):
        super().__init__()
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, glyph_ids: torch.Tensor,
                glyph_mask: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
        hidden = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        glyph = self.text_encoder_2(input_ids=glyph_ids, attention_mask=glyph_mask.float())[0]
        has_glyph = glyph_mask.any(dim=1).view(-1, 1, 1)  # the pipeline encodes a text without quotes as zeros
        glyph = torch.where(has_glyph, glyph, torch.zeros_like(glyph))
        return {"embeds": hidden[HIDDEN_STATE][:, TEMPLATE_PREFIX:], "glyph_embeds": glyph}


class HunyuanDenoiseStep(nn.Module):
    """One HunyuanVideo15Pipeline denoise step for text-to-video: the cond branch, the uncond branch
    (when `cfg`), ClassifierFreeGuidance's combine, the flow-matching Euler update."""

    def __init__(self, denoiser: HunyuanVideo15TextToVideo, sampler: FlowEulerSampler, cfg: bool, tap_points: TapPoints | None = None):
        super().__init__()
        self.denoiser = denoiser
        self.sampler = sampler
        self.cfg = cfg
        self.tap_points = tap_points  # parity runs only: block outputs as "tap.*" outputs
        self.cfg_split = None  # no CFG-parallel plan for this family yet
        self.fuse_branches = False  # CFG fusion (passes/cfg_fusion.py) sets it while the step is traced

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, h, w] float32
        timestep: torch.Tensor,  # [B] sigma x 1000
        coeffs: torch.Tensor,  # [B, 2] this step's Euler row
        prompt_embeds: torch.Tensor,  # [B, 1000, D] Qwen2.5-VL's
        prompt_embeds_mask: torch.Tensor,  # [B, 1000] int64
        prompt_embeds_2: torch.Tensor,  # [B, 256, D2] ByT5's (zeros without quoted text)
        prompt_embeds_mask_2: torch.Tensor,  # [B, 256] int64
        negative_prompt_embeds: torch.Tensor | None = None,  # the same four for the negative text, when cfg
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds_2: torch.Tensor | None = None,
        negative_prompt_embeds_mask_2: torch.Tensor | None = None,
        guidance_scale: torch.Tensor | None = None,  # [B], when cfg
        condition: torch.Tensor | None = None,  # [B, C + 1, F, h, w] image-to-video: the image's latents on frame 0, the mask
        image_embeds: torch.Tensor | None = None,  # [B, N, D'] image-to-video: SigLIP's last hidden state
        lora_index: torch.Tensor | None = None,  # [B, K] int64 each row's adapter slots, on an engine with them
        lora_scale: torch.Tensor | None = None,  # [B, K] float32 their scales (0 where unused)
        **carry: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        dtype = prompt_embeds.dtype
        # 1. [latents, condition latents, mask] on the channels, in the denoiser's dtype: zeros for text-to-video
        model_input = denoiser_input(latents, condition, dtype)
        image = {} if image_embeds is None else {"image_embeds": mark_request_constant(image_embeds)}
        t = timestep.to(dtype)
        texts = {"cond": (prompt_embeds, prompt_embeds_mask, prompt_embeds_2, prompt_embeds_mask_2)}
        if self.cfg:
            texts["uncond"] = (negative_prompt_embeds, negative_prompt_embeds_mask, negative_prompt_embeds_2, negative_prompt_embeds_mask_2)
        # 2. each branch (fused into one call while traced with CFG fusion)
        rows = {} if lora_index is None else {"lora_index": mark_request_constant(lora_index),
                                              "lora_scale": mark_request_constant(lora_scale)}  # fmt: skip
        calls = {branch: dict(hidden_states=model_input, timestep=t, encoder_hidden_states=mark_request_constant(e),
                              encoder_attention_mask=mark_request_constant(m), encoder_hidden_states_2=mark_request_constant(e2),
                              encoder_attention_mask_2=mark_request_constant(m2), **image, **rows)
                 for branch, (e, m, e2, m2) in texts.items()}  # fmt: skip
        outputs = call_branches("denoiser", self._denoiser, calls, self.fuse_branches)
        noise = outputs["cond"][0]
        taps = {"tap.noise.cond": noise}
        # 3. ClassifierFreeGuidance: uncond + scale * (cond - uncond)
        if self.cfg:
            uncond = outputs["uncond"][0]
            noise = guided(noise, uncond, guidance_scale)
            taps["tap.noise.uncond"], taps["tap.noise"] = uncond, noise
        # 4. the Euler update (a rollout's SDE step with its fresh noise)
        out = sampler_update(self.sampler, latents, noise, carry, coeffs, carry.get("fresh_noise"))
        if self.tap_points is not None:
            out.update(taps)
            out.update(self.tap_points.drain())
        return out

    def _denoiser(self, lora_index: torch.Tensor | None = None, lora_scale: torch.Tensor | None = None,
                  **inputs: torch.Tensor) -> tuple[torch.Tensor]:  # fmt: skip
        """The denoiser's call; the adapted linears (fvgraph/adapters/slots.py) read the rows' adapters
        for its duration (the traced forward runs the transformer's submodules, not its hooked call)."""
        store = slot_store(self.denoiser.transformer)
        if store is not None:
            store.choose(lora_index, lora_scale)
        noise = self.denoiser(**inputs, return_dict=False)[0]
        if store is not None:
            store.release()
        return (noise,)

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]:
        """(tokens, head_dim, dtype) of the blocks' joint attention (fvgraph.kernels.attention)."""
        transformer = self.denoiser.transformer
        image = {} if inputs.get("image_embeds") is None else {"image_tokens": inputs["image_embeds"].shape[1]}
        tokens = attention_tokens(transformer, inputs["latents"], inputs["prompt_embeds"].shape[1], inputs["prompt_embeds_2"].shape[1],
                                  **image)  # fmt: skip
        return tokens, transformer.config.attention_head_dim, inputs["prompt_embeds"].dtype


class HunyuanVaeDecodeStep(nn.Module):
    """Latents -> video in [0, 1], [B, 3, F, H, W]: divided by the VAE's scaling factor and decoded, as the pipeline."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        video = self.vae.decode(self.vae_latents(latents), return_dict=False)[0]
        return {"video": self.postprocess(video)}

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.to(self.vae.dtype) / self.scaling_factor

    @staticmethod
    def postprocess(video: torch.Tensor) -> torch.Tensor:
        """The VAE's output in [-1, 1] -> [0, 1], as diffusers' video processor."""
        return (video / 2 + 0.5).clamp(0, 1)
