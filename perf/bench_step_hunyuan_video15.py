"""perf/bench_step.py's HunyuanVideo-1.5 step: the texts both sides encode and the diffusers case.

The diffusers case runs the body of HunyuanVideo15Pipeline's denoise loop for text-to-video on a batch
of latents in lockstep: the latents with zero condition latents and a zero mask on the channels, zero
image embeddings, its ClassifierFreeGuidance guider splitting the cond and uncond texts into one
transformer call each (inside `cache_context`, as the pipeline calls it), the guider's combine, and
the scheduler's Euler step on the shifted sigmas linspace(1, 0, N + 1)[:-1]. The texts are encoded
once, untimed, by the pipeline's own `encode_prompt` on the baseline's untouched text encoders; fvgraph
encodes the same texts in its untimed first tick.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

from fvgraph.models.components import Components, diffusers_scheduler
from fvgraph.models.hunyuan_video15_forward import VISION_TOKENS
from fvgraph.perf.method import Case

FAMILY = "hunyuan_video15"
# A quoted text, so ByT5's tokens are valid ones too; the negative text quotes nothing (ByT5 zeros, zero mask).
TEXTS = {"prompt": 'a neon shop sign that reads "OPEN LATE" above a wet street at night, slow dolly in',
         "negative_prompt": "blurry, low quality, distorted text"}  # fmt: skip
GLYPH_LEN = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length


def attention_inputs(components: Components) -> dict[str, torch.Tensor]:
    """ByT5's embeddings as the step reads their shape (fvgraph's attention_shape): [1, 256, D2]."""
    width = components.transformer.config.text_embed_2_dim
    return {"prompt_embeds_2": torch.zeros(1, GLYPH_LEN, width)}


def encoded_texts(components: Components, device: torch.device, batch: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """TEXTS through HunyuanVideo15Pipeline.encode_prompt on `components`' own encoders and tokenizers:
    per transformer argument, its (cond, uncond) pair at `batch` rows, as the guider takes them."""
    pipe = HunyuanVideo15Pipeline(transformer=components.transformer, vae=components.vae, text_encoder=components.text_encoder,
                                  tokenizer=components.tokenizer, text_encoder_2=components.text_encoder_2,
                                  tokenizer_2=components.tokenizer_2, scheduler=None, guider=ClassifierFreeGuidance())  # fmt: skip
    dtype = components.transformer.dtype
    with torch.no_grad():
        cond, uncond = (pipe.encode_prompt(TEXTS[key], device=device, dtype=dtype, batch_size=batch) for key in TEXTS)
    names = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2")
    return {name: (c, u) for name, c, u in zip(names, cond, uncond)}


def step_case(name: str, transformer, components: Components, sampler_spec, latents: torch.Tensor, guidance: float,
              num_steps: int) -> Case:  # fmt: skip
    """One HunyuanVideo15Pipeline text-to-video denoise step per run on `latents` [B, C, F, h, w] (held
    in the transformer's dtype, as the pipeline holds them); the schedule restarts (untimed) when it runs out."""
    device, dtype, batch = latents.device, transformer.dtype, latents.shape[0]
    scheduler, guider = diffusers_scheduler(sampler_spec), ClassifierFreeGuidance(guidance_scale=guidance)
    texts = encoded_texts(components, device, batch)
    cond_latents = torch.zeros_like(latents, dtype=dtype)
    mask = torch.zeros(batch, 1, *latents.shape[2:], dtype=dtype, device=device)
    image_embeds = torch.zeros(batch, VISION_TOKENS, transformer.config.image_embed_dim, dtype=dtype, device=device)
    state = {"i": num_steps, "latents": latents}

    def before():
        if state["i"] == num_steps:
            retrieve_timesteps(scheduler, num_steps, device, sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
            state.update(i=0, latents=latents.to(dtype).clone())

    def run():
        i, x = state["i"], state["latents"]
        t = scheduler.timesteps[i]
        model_input = torch.cat([x, cond_latents, mask], dim=1)
        timestep = t.expand(batch).to(model_input.dtype)
        guider.set_state(step=i, num_inference_steps=num_steps, timestep=t)
        guider_state = guider.prepare_inputs(texts)
        with torch.no_grad():
            for branch in guider_state:
                guider.prepare_models(transformer)
                with transformer.cache_context(getattr(branch, guider._identifier_key)):
                    branch.noise_pred = transformer(hidden_states=model_input, image_embeds=image_embeds, timestep=timestep,
                                                    return_dict=False, **{k: getattr(branch, k) for k in texts})[0]  # fmt: skip
                guider.cleanup_models(transformer)
            noise = guider(guider_state)[0]
            state["latents"] = scheduler.step(noise, t, x, return_dict=False)[0]
        state["i"] += 1

    return Case(name, run, before)
