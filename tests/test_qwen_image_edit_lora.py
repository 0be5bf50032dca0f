"""LoRA adapters on Qwen-Image-Edit (tiny-qwen-image-edit), checked against diffusers' own loading:
QwenImageEditPipeline from a checkpoint its save_pretrained wrote (weights of its own), with
`load_lora_weights` + `set_adapters`, true CFG and a conditioning image of another size than the
output. At -O1 the edited image's tokens are a request constant whose projections are hoisted
through the adapted linears. The adapter covers the image embedder `img_in`, which also embeds the condition image's
tokens, and the text embedder `txt_in`. A batch mixing adapted and plain edits equals each alone."""

import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImagePipeline

from fvgraph.adapters.slots import LoraSlots
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec
from lora_files import ATTENTION, peft_lora
from qwen_edit_checkpoint import edit_image, edit_reference_pipeline, save_tiny_edit_checkpoint
from reference_helpers import assert_matches_reference, assert_within_compiled_noise

SLOTS = LoraSlots(max_loras=4, max_lora_rank=8, max_loras_per_request=2)
TARGETS = [*ATTENTION, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_in", "img_in", "img_mod.1"]
EDIT = dict(prompt="make it winter", negative_prompt="blurry", true_cfg_scale=2.5, num_inference_steps=3, height=32, width=48)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("edit-loras")
    return {"a": peft_lora(d / "a", 3, TARGETS, rank=4, alpha=4.0, card="tiny-qwen-image-edit"),
            "b": peft_lora(d / "b", 4, ["to_q", "to_v", "img_mlp.net.2"], rank=2, alpha=4.0, card="tiny-qwen-image-edit")}  # fmt: skip


@pytest.fixture(scope="module")
def engine(files):
    return Engine.from_card("tiny-qwen-image-edit", device="cpu", loras=files, lora_slots=SLOTS)


def _latents(engine, *requests) -> list[torch.Tensor]:
    results = engine.generate(list(requests))
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.latents for r in results]


def test_edit_adapters_equal_qwen_image_edit_pipeline_load_lora_weights_and_set_adapters(tmp_path, files, engine):
    image = edit_image(1, 300, 500)  # resized to 800 x 1312 for the VAE and the vision-language encoder
    adapters = {"a": 0.8, "b": 0.6}
    base, adapted = _latents(engine, Request(image=image, seed=5, output_type="latent", **EDIT),
                             Request(image=image, seed=5, output_type="latent", loras=adapters, **EDIT))  # fmt: skip
    pipe = edit_reference_pipeline(save_tiny_edit_checkpoint(tmp_path / "checkpoint"))
    for name in adapters:
        pipe.load_lora_weights(str(files[name]), adapter_name=name)
    pipe.set_adapters(list(adapters), list(adapters.values()))
    packed = pipe(image=image, generator=torch.Generator().manual_seed(5), output_type="latent", **EDIT).images
    reference = QwenImagePipeline._unpack_latents(packed, EDIT["height"], EDIT["width"], pipe.vae_scale_factor)
    assert isinstance(pipe, QwenImageEditPipeline)
    assert_matches_reference(adapted, reference)
    assert (adapted - base).abs().max() > 0.1  # the adapters move the edit far beyond the tolerance


def test_a_batch_of_edits_with_and_without_adapters_equals_each_alone(engine):
    """Other images (one aspect ratio, so one shape), seeds and adapter choices in one generate() at -O0."""
    mix = [({"a": 0.8}, edit_image(2, 64, 96)), (None, edit_image(3, 128, 192)), ({"a": 0.5, "b": 1.0}, edit_image(4, 64, 96))]
    requests = lambda: [Request(image=image, seed=i, output_type="latent", loras=loras, request_id=str(i), **EDIT)  # noqa: E731
                        for i, (loras, image) in enumerate(mix)]  # fmt: skip
    alone = [_latents(engine, r)[0] for r in requests()]
    together = _latents(engine, *requests())
    for ours, reference in zip(together, alone):
        assert torch.equal(ours, reference)
    assert len({tuple(x.flatten()[:8].tolist()) for x in alone}) == 3


def test_a_compiled_batch_with_and_without_an_adapter_equals_each_alone_and_recompiles_for_nothing(files, engine):
    """-O1 (aot_eager), bucket 2: the condition image's embedding through the adapted `img_in` is hoisted per
    request; other seeds, images and adapter rows in a second wave run the same graph."""
    mix = [({"a": 0.8}, edit_image(2, 64, 96)), (None, edit_image(3, 128, 192))]
    requests = lambda seed: [Request(image=image, seed=seed + i, output_type="latent", loras=loras, request_id=str(i), **EDIT)  # noqa: E731
                             for i, (loras, image) in enumerate(mix)]  # fmt: skip
    alone = [_latents(engine, r)[0] for r in requests(0)]
    compiled = Engine.from_card("tiny-qwen-image-edit", device="cpu", loras=files, lora_slots=SLOTS, opt_level=1,
                                compile_config=CompileConfig(backend="aot_eager"), buckets=BucketSpec(batch_sizes=(2,)))  # fmt: skip
    for ours, reference in zip(_latents(compiled, *requests(0)), alone):
        assert_within_compiled_noise(ours, reference)
    assert compiled.counters.batches < compiled.counters.compiled_steps  # the two ran as one batch
    compiles = compiled.counters.compiles
    swapped = [r.model_copy(update={"loras": other.loras}) for r, other in zip(requests(5), requests(5)[::-1])]
    assert all(r.ok for r in compiled.generate(swapped)) and compiled.counters.compiles == compiles
