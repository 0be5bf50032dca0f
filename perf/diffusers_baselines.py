"""The diffusers baselines the benchmarks compare fvgraph with, each on its own untouched copy of the
card's weights (never the engine's module instances, whose forwards fvgraph may have rebound).

    eager                   diffusers' WanTransformer3DModel as it is
    compile_repeated_blocks diffusers' regional compile: `transformer.compile_repeated_blocks(fullgraph=True)`
    torch_compile           the whole transformer through `torch.compile(fullgraph=True)`

A step is the body of the family's pipeline loop: WanPipeline's cond and uncond transformer calls,
guidance combine and scheduler step (`diffusers_step_case`), or FluxPipeline's one transformer call on
packed latents with the embedded guidance and its scheduler step (`flux_step_case`; with an edited image's
latents, FluxKontextPipeline's call: its tokens joined after the latents', the prediction read from the latents').
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxKontextPipeline, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from fvgraph.cards import get_card
from fvgraph.models.components import Components, load_components
from fvgraph.perf.method import Case
from fvgraph.models.components import diffusers_scheduler

BASELINES = ("eager", "compile_repeated_blocks", "torch_compile")


def untouched_components(card_id: str, device: torch.device, weights_version: str | None = None) -> Components:
    """A fresh build of the card's seeded components; `weights_version` (the engine's) must match, so
    the baseline runs the same weights."""
    components = load_components(get_card(card_id), None, device)
    if weights_version is not None and components.weights_version != weights_version:
        raise RuntimeError(f"baseline weights {components.weights_version} differ from the engine's {weights_version}")
    return components


def baseline_transformer(kind: str, components: Components) -> torch.nn.Module:
    """The components' transformer prepared as baseline `kind` (compiling happens at its first call)."""
    transformer = components.transformer
    if kind == "eager":
        return transformer
    if kind == "compile_repeated_blocks":
        transformer.compile_repeated_blocks(fullgraph=True)
        return transformer
    if kind == "torch_compile":
        return torch.compile(transformer, fullgraph=True)
    raise ValueError(f"baseline={kind!r}: expected one of {BASELINES}")


def diffusers_step_case(name: str, transformer, sampler_spec, latents: torch.Tensor, pe: torch.Tensor,
                        ne: torch.Tensor, guidance: float, num_steps: int) -> Case:  # fmt: skip
    """One WanPipeline denoise step per run, on a batch of `latents.shape[0]` requests in lockstep;
    the schedule restarts (untimed) when it runs out."""
    scheduler = diffusers_scheduler(sampler_spec)
    state = {"i": num_steps, "latents": latents}
    pe, ne = pe.expand(latents.shape[0], -1, -1), ne.expand(latents.shape[0], -1, -1)

    def before():
        if state["i"] == num_steps:
            scheduler.set_timesteps(num_steps, device=latents.device)
            state.update(i=0, latents=latents.clone())

    def run():
        t = scheduler.timesteps[state["i"]]
        x = state["latents"].to(pe.dtype)
        timestep = t.expand(x.shape[0])
        with torch.no_grad():
            cond = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=pe, return_dict=False)[0]
            uncond = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=ne, return_dict=False)[0]
            noise = uncond + guidance * (cond - uncond)
            state["latents"] = scheduler.step(noise, t, state["latents"], return_dict=False)[0]
        state["i"] += 1

    return Case(name, run, before)


def flux_step_case(name: str, transformer, sampler_spec, latents: torch.Tensor, pe: torch.Tensor, pooled: torch.Tensor,
                   guidance: float, num_steps: int, vae_spatial: int, condition: torch.Tensor | None = None) -> Case:  # fmt: skip
    """One FluxPipeline denoise step per run on `latents` [B, C, 1, h, w] (packed once, as the pipeline
    holds them), with its shifted schedule, position ids and embedded guidance; restarts untimed. With
    `condition` [1, C, 1, hc, wc] (an edited image's latents), FluxKontextPipeline's step."""
    batch, channels, _, h, w = latents.shape
    packed = FluxPipeline._pack_latents(latents[:, :, 0], batch, channels, h, w)
    joined, joined_ids = _kontext_condition(condition, batch, pe.device, pe.dtype)
    scheduler = diffusers_scheduler(sampler_spec)
    config = scheduler.config
    mu = calculate_shift(packed.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))  # fmt: skip
    dtype, device = pe.dtype, pe.device
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, h // 2, w // 2, device, dtype)
    img_ids = img_ids if joined is None else torch.cat([img_ids, joined_ids])
    txt_ids = torch.zeros(pe.shape[1], 3, device=device, dtype=dtype)
    pe, pooled = pe.expand(batch, -1, -1), pooled.expand(batch, -1)
    embedded = torch.full([batch], guidance, device=device, dtype=torch.float32) if transformer.config.guidance_embeds else None
    state = {"i": num_steps, "latents": packed}

    def before():
        if state["i"] == num_steps:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
            retrieve_timesteps(scheduler, num_steps, device, sigmas=sigmas, mu=mu)
            state.update(i=0, latents=packed.to(dtype).clone())

    def run():
        t = scheduler.timesteps[state["i"]]
        x = state["latents"]
        x_in = x if joined is None else torch.cat([x, joined], dim=1)
        with torch.no_grad():
            noise = transformer(hidden_states=x_in, timestep=t.expand(batch).to(x.dtype) / 1000, guidance=embedded,
                                pooled_projections=pooled, encoder_hidden_states=pe, txt_ids=txt_ids, img_ids=img_ids,
                                return_dict=False)[0][:, : x.shape[1]]  # fmt: skip
            state["latents"] = scheduler.step(noise, t, x, return_dict=False)[0]
        state["i"] += 1

    return Case(name, run, before)


def _kontext_condition(condition: torch.Tensor | None, batch: int, device: torch.device, dtype: torch.dtype):
    """FluxKontextPipeline.prepare_latents' image latents and ids: packed, repeated to the batch, ids' first axis 1."""
    if condition is None:
        return None, None
    _, channels, _, hc, wc = condition.shape
    joined = FluxKontextPipeline._pack_latents(condition[:, :, 0].expand(batch, -1, -1, -1), batch, channels, hc, wc)
    ids = FluxKontextPipeline._prepare_latent_image_ids(batch, hc // 2, wc // 2, device, dtype)
    ids[..., 0] = 1
    return joined.to(device, dtype), ids
