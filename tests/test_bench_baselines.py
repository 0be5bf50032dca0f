"""The benchmarks' diffusers baselines run what diffusers' pipelines run: FLUX.1 Kontext's step case
(perf/diffusers_baselines.flux_step_case with an edited image's latents) calls the transformer with
the inputs FluxKontextPipeline calls it with, step after step, on tiny-flux-kontext."""

import inspect

import numpy as np
import PIL.Image
import torch
from diffusers import FluxKontextPipeline

from fvgraph.cards import get_card
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.perf.diffusers_baselines import flux_step_case

STEPS, HEIGHT, WIDTH, GUIDANCE = 3, 32, 48, 2.5
RECORDED = ("hidden_states", "timestep", "guidance", "img_ids", "txt_ids", "encoder_hidden_states", "pooled_projections")


def _recorded_calls(transformer, run) -> list[dict[str, torch.Tensor]]:
    calls = []
    hook = transformer.register_forward_pre_hook(lambda m, a, kw: calls.append({k: kw[k].clone() for k in RECORDED}), with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return calls


def test_the_kontext_step_case_calls_the_transformer_as_flux_kontext_pipeline_does():
    card = get_card("tiny-flux-kontext")
    c = load_components(card, None, torch.device("cpu"))
    accepted = inspect.signature(FluxKontextPipeline.__init__).parameters
    modules = {k: m for k, m in c.modules().items() if k in accepted}
    pipe = FluxKontextPipeline(**modules, scheduler=diffusers_scheduler(card.recipe.sampler))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    pe, pooled = torch.randn(1, 32, 32, generator=g), torch.randn(1, 32, generator=g)
    latents = torch.randn(1, 16, 1, HEIGHT // 8, WIDTH // 8, generator=g)
    image = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))
    packed = FluxKontextPipeline._pack_latents(latents[:, :, 0], 1, 16, HEIGHT // 8, WIDTH // 8)
    args = dict(prompt_embeds=pe, pooled_prompt_embeds=pooled, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, max_area=HEIGHT * WIDTH, _auto_resize=False, output_type="latent")  # fmt: skip
    expected = _recorded_calls(pipe.transformer, lambda: pipe(image=image, latents=packed, **args))
    encoded = pipe._encode_vae_image(pipe.image_processor.preprocess(image, HEIGHT, WIDTH), generator=None)
    case = flux_step_case("kontext", pipe.transformer, card.recipe.sampler, latents, pe, pooled, GUIDANCE, STEPS, 8, encoded.unsqueeze(2))

    def run_schedule():
        for _ in range(STEPS):
            case.before()
            case.run()

    ours = _recorded_calls(pipe.transformer, run_schedule)
    assert len(ours) == len(expected) == STEPS
    assert ours[0]["hidden_states"].shape[1] == 2 * (HEIGHT // 16) * (WIDTH // 16)  # the latents' tokens, then the image's
    for step, (a, b) in enumerate(zip(ours, expected)):
        for name in RECORDED:
            torch.testing.assert_close(a[name], b[name], atol=0, rtol=0, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
