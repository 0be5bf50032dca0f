"""FLUX.1 Kontext editing (card flux.1-kontext-dev, embedded tiny-flux-kontext): equal to diffusers'
FluxKontextPipeline on a checkpoint it wrote itself, with a conditioning image of another size than the
output (resized to its Kontext resolution, or kept at its own size with auto_resize=False), embedded guidance and true CFG; edits interleave and a
second wave compiles nothing; an edit card refuses a request without an image, naming it; a FLUX LoRA
equals FluxKontextPipeline's own loader."""

import inspect

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import FluxKontextPipeline

from fvgraph.adapters.slots import LoraSlots
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig
from fvgraph.contract.phase import Phase
from fvgraph.engine.engine import Engine
from fvgraph.models.components import diffusers_scheduler, load_components
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from lora_files import peft_lora
from reference_helpers import REFERENCE_TOLERANCE, assert_matches_reference, assert_shares_no_storage, reference_pipeline, saved_pipeline


def _image(seed: int, h: int, w: int) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def kontext_checkpoint(tmp_path_factory):
    """tiny-flux-kontext's seeded weights written by FluxKontextPipeline.save_pretrained."""
    card = get_card("tiny-flux-kontext")
    c = load_components(card, None, torch.device("cpu"))
    return saved_pipeline(FluxKontextPipeline, c, tmp_path_factory.mktemp("tiny-kontext"), scheduler=diffusers_scheduler(card.recipe.sampler))


CASES = {
    # a wide image: the Kontext resolution nearest its aspect ratio is 1392 x 752
    "embedded guidance": dict(prompt="make it winter", guidance_scale=2.5, num_inference_steps=3, height=48, width=64, image=(1, 300, 560)),
    "true cfg, a tall image": dict(prompt="make it winter", negative_prompt="blurry", true_cfg_scale=3.0, guidance_scale=2.0,
                                   num_inference_steps=2, height=64, width=32, image=(2, 500, 260)),
    # the pipeline's _auto_resize=False: the image encoded at its own size, 56 x 88 rounded down to 48 x 80
    "no auto-resize": dict(prompt="make it winter", guidance_scale=2.5, num_inference_steps=2, height=32, width=48, image=(3, 56, 88),
                           auto_resize=False),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_kontext_on_a_diffusers_checkpoint_matches_flux_kontext_pipeline(kontext_checkpoint, case):
    engine = Engine.from_card("flux.1-kontext-dev", checkpoint=kontext_checkpoint, device="cpu", dtype="fp32")  # a bf16 release
    pipe = reference_pipeline(FluxKontextPipeline, kontext_checkpoint)
    assert_shares_no_storage(engine, pipe)
    args = dict(CASES[case])
    image, auto_resize = _image(*args.pop("image")), args.pop("auto_resize", None)
    resize = {} if auto_resize is None else {"_auto_resize": auto_resize}
    # max_area = the output's own: the pipeline rescales the output to max_area, fvgraph keeps the request's size.
    packed = pipe(image=image, generator=torch.Generator().manual_seed(7), output_type="latent", max_area=args["height"] * args["width"],
                  **resize, **args).images  # fmt: skip
    reference = FluxKontextPipeline._unpack_latents(packed, args["height"], args["width"], pipe.vae_scale_factor).unsqueeze(2)
    [result] = engine.generate([Request(image=image, seed=7, output_type="latent", auto_resize=auto_resize, **args)])
    assert result.ok, result.error
    assert_matches_reference(result.latents, reference)
    [other] = engine.generate([Request(image=_image(9, *image.size[::-1]), seed=7, output_type="latent", auto_resize=auto_resize, **args)])
    # Another image moves the result (by 3.7e-3 on the first case: tiny random weights attend little
    # to it), two orders of magnitude past the reference tolerance: an edit that ignored it would fail.
    assert (other.latents - result.latents).abs().max() > 100 * REFERENCE_TOLERANCE.atol


def _requests(steps: int = 2, guidance: float = 2.5):
    return [Request(prompt="add a hat", image=_image(3, 64, 96), seed=1, num_inference_steps=steps, guidance_scale=guidance,
                    height=32, width=48, output_type="latent"),
            Request(prompt="make it night", image=_image(4, 80, 80), seed=2, num_inference_steps=steps, guidance_scale=guidance,
                    height=32, width=48, output_type="latent")]  # fmt: skip


def test_interleaved_edits_equal_each_alone_and_a_second_wave_compiles_nothing():
    eager = Engine.from_card("tiny-flux-kontext", device="cpu")
    alone = [eager.generate([r])[0].latents for r in _requests()]
    together = [r.latents for r in eager.generate(_requests())]
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    compiled = Engine.from_card("tiny-flux-kontext", device="cpu", opt_level=1, compile_config=CompileConfig(backend="aot_eager"),
                                buckets=BucketSpec(batch_sizes=(2,)))  # fmt: skip
    first = compiled.generate(_requests())
    assert all(r.ok for r in first), [r.error for r in first]
    compiles = compiled.counters.compiles
    tolerance = compiled.card.parity.tolerance("fp32")
    for ours, reference in zip(first, alone):
        torch.testing.assert_close(ours.latents, reference, atol=tolerance.atol, rtol=tolerance.rtol)
    second = compiled.generate(_requests(steps=3, guidance=4.0))  # other steps, guidance, seeds: the same graph
    assert all(r.ok for r in second) and compiled.counters.compiles == compiles


def test_an_edit_card_refuses_a_request_without_an_image_naming_it():
    engine = Engine.from_card("tiny-flux-kontext", device="cpu")
    [result] = engine.generate([Request(prompt="a fox", num_inference_steps=2)])
    assert result.status == "rejected" and result.error.startswith("image:") and "edits an image" in result.error


def test_a_kontext_adapter_equals_flux_kontext_pipeline_load_lora_weights(tmp_path):
    """A FLUX LoRA on the edit card loads through the card's own pipeline class (FluxKontextPipeline's
    loader) and equals that pipeline with `load_lora_weights` + `set_adapters` on untouched weights."""
    lora = peft_lora(tmp_path / "kontext", 11, ["to_q", "to_k", "to_v", "add_q_proj", "to_add_out", "proj_mlp"], rank=4,
                     alpha=8.0, card="tiny-flux-kontext")  # fmt: skip
    slots = LoraSlots(max_loras=2, max_lora_rank=8, max_loras_per_request=1)
    engine = Engine.from_card("tiny-flux-kontext", device="cpu", loras={"winter": lora}, lora_slots=slots)
    args = dict(prompt="make it winter", guidance_scale=2.5, num_inference_steps=3, height=48, width=64, max_sequence_length=32)
    image = _image(1, 96, 128)
    base, adapted = (engine.generate([Request(image=image, seed=7, output_type="latent", loras=loras, **args)])[0]
                     for loras in (None, {"winter": 0.8}))  # fmt: skip
    assert base.ok and adapted.ok, (base.error, adapted.error)
    card = get_card("tiny-flux-kontext")
    c = load_components(card, None, torch.device("cpu"))
    pipe = FluxKontextPipeline(**{k: m for k, m in c.modules().items() if k in inspect.signature(FluxKontextPipeline.__init__).parameters},
                               scheduler=diffusers_scheduler(card.recipe.sampler))  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora), adapter_name="winter")
    pipe.set_adapters(["winter"], [0.8])
    packed = pipe(image=image, generator=torch.Generator().manual_seed(7), output_type="latent", max_area=args["height"] * args["width"],
                  **args).images  # fmt: skip
    reference = FluxKontextPipeline._unpack_latents(packed, args["height"], args["width"], pipe.vae_scale_factor).unsqueeze(2)
    assert_matches_reference(adapted.latents, reference)
    assert (adapted.latents - base.latents).abs().max() > 0.1  # the adapter moves the edit far beyond the tolerance


@pytest.fixture(scope="module")
def kontext_checkpoint_512_tiles(tmp_path_factory):
    """tiny-flux-kontext's weights written by FluxKontextPipeline.save_pretrained with a VAE config
    whose sample_size is 512 (FLUX.1's is 1024; the card's tiny one, 32, would cut a Kontext-sized
    image into some 1,800 tiles): the tiles diffusers' `enable_tiling()` takes from it."""
    card = get_card("tiny-flux-kontext")
    c = load_components(card, None, torch.device("cpu"))
    c.vae.register_to_config(sample_size=512)
    return saved_pipeline(FluxKontextPipeline, c, tmp_path_factory.mktemp("tiny-kontext-512"), scheduler=diffusers_scheduler(card.recipe.sampler))


def test_a_tiled_kontext_encode_runs_in_tiles_and_equals_flux_kontext_pipeline_with_tiling(kontext_checkpoint_512_tiles):
    """vae_tiling=True tiles the edit's encode as AutoencoderKL's `_tiled_encode`: one step per tile,
    then the end, equal to FluxKontextPipeline after `pipe.vae.enable_tiling()`."""
    folder = kontext_checkpoint_512_tiles
    engine = Engine.from_card("flux.1-kontext-dev", checkpoint=folder, device="cpu", dtype="fp32", vae_tiling=True)
    args = dict(prompt="make it winter", guidance_scale=2.5, num_inference_steps=2, height=32, width=48)
    image = _image(5, 60, 80)  # resized to 1184 x 880: 3 x 4 tiles of 512 pixels every 384
    state = engine.start(Request(image=image, seed=3, output_type="latent", **args))
    kinds = []
    while state.phase != Phase.DENOISE:
        kinds.append(engine.loop.next(state).kind)
        engine.step(state)
    assert kinds.count("vae_encode_tile") == 12 and kinds[-1] == "vae_encode_end" and "vae_encode" not in kinds
    [result] = engine.generate([Request(image=image, seed=3, output_type="latent", **args)])
    pipe = reference_pipeline(FluxKontextPipeline, folder)

    def reference() -> torch.Tensor:
        packed = pipe(image=image, generator=torch.Generator().manual_seed(3), output_type="latent", max_area=args["height"] * args["width"],
                      **args).images  # fmt: skip
        return FluxKontextPipeline._unpack_latents(packed, args["height"], args["width"], pipe.vae_scale_factor).unsqueeze(2)

    untiled = reference()
    pipe.vae.enable_tiling()
    assert_matches_reference(result.latents, reference())
    # Tiling moves the result by 1.8e-3 (tiny random weights attend little to the edit's tokens, as
    # above), 60x the reference tolerance: an untiled encode would fail the comparison above.
    assert (result.latents - untiled).abs().max() > 30 * REFERENCE_TOLERANCE.atol
