"""Cards read facts from the weights: a resized checkpoint of the family loads with the family's card
and is checked against its own widths; an engine can be built without its text encoder."""

import json

import pytest
import torch

from fvgraph.cards import get_card
from fvgraph.models.components import load_components
from fvgraph.engine.engine import Engine
from fvgraph.request import Request, RequestRejected
from conftest import embeds


@pytest.fixture(scope="module")
def resized_checkpoint(tmp_path_factory, tiny_card):
    """tiny-wan resized: text width 48 instead of 32, patch (1, 2, 2) kept, saved with save_pretrained."""
    dit = {**tiny_card.components["transformer"].config, "text_dim": 48}
    te = {**tiny_card.components["text_encoder"].config, "d_model": 48}
    spec = {name: c.model_copy(update={"config": {"transformer": dit, "text_encoder": te}.get(name, c.config)})
            for name, c in tiny_card.components.items()}  # fmt: skip
    card = tiny_card.model_copy(update={"components": spec})
    folder = tmp_path_factory.mktemp("resized")
    load_components(card, None, torch.device("cpu")).save_pretrained(folder, card)
    return folder


def test_the_facts_come_from_the_weights_configs(tiny_engine):
    facts = tiny_engine.facts
    assert (facts.text_dim, facts.latent_channels, facts.patch_size) == (32, 16, (1, 2, 2))
    assert (facts.vae_spatial, facts.vae_temporal, facts.spatial_multiple) == (8, 4, 16)
    assert facts.experts == ("transformer",) and facts.image_dim is None


def test_a_resized_checkpoint_loads_with_the_family_card_and_serves_its_own_width(resized_checkpoint):
    engine = Engine.from_card("tiny-wan", checkpoint=resized_checkpoint, device="cpu")
    assert engine.facts.text_dim == 48
    g = torch.Generator().manual_seed(0)
    wide, narrow = torch.randn(8, 48, generator=g), torch.randn(8, 32, generator=g)
    ok, rejected, text = engine.generate([
        Request(prompt_embeds=wide, guidance_scale=1.0, seed=0, num_inference_steps=2, num_frames=1),
        Request(prompt_embeds=narrow, guidance_scale=1.0, seed=0, num_inference_steps=2, num_frames=1),
        Request(prompt="a fox", seed=0, num_inference_steps=2, num_frames=1),
    ])  # fmt: skip
    assert ok.ok and text.ok, (ok.error, text.error)
    assert rejected.status == "rejected" and "[seq_len <= 32, 48]" in rejected.error


def test_geometry_rules_follow_the_loaded_vae_and_patch(tiny_engine, tiny_card):
    """A denoiser with patch 4 needs multiples of 32: the rule comes from its config, not the card."""
    spec = tiny_card.components["transformer"]
    card = tiny_card.model_copy(update={"components": {
        **tiny_card.components, "transformer": spec.model_copy(update={"config": {**spec.config, "patch_size": (1, 4, 4)}})}})  # fmt: skip
    engine = Engine.from_card(card, device="cpu", text_encoder=False)
    assert engine.facts.spatial_multiple == 32
    with pytest.raises(RequestRejected, match=r"height: 48 must be a multiple of 32 .*VAE x8, patch x4"):
        engine.start(Request(prompt_embeds=torch.zeros(4, 32), height=48, width=64, guidance_scale=1.0))


def test_without_a_text_encoder_embeddings_serve_and_text_is_rejected_saying_why(tiny_engine, tiny_card):
    lean = Engine.from_card("tiny-wan", device="cpu", text_encoder=False)
    assert lean.loop.components.text_encoder is None and lean.loop.components.tokenizer is None
    assert "text_encode" not in lean.executor.steps
    pos, neg = embeds(3, tiny_card)
    short = pos[0, :5]  # zero-padded to the text length, as Wan pads its encoder output
    request = dict(seed=2, num_inference_steps=2, num_frames=5, output_type="latent")
    served, text, no_negative = lean.generate([
        Request(prompt_embeds=short, negative_prompt_embeds=neg, **request),
        Request(prompt="a fox", **request),
        Request(prompt_embeds=pos, **request),
    ])  # fmt: skip
    assert served.ok
    padded = torch.cat([short, torch.zeros(tiny_card.shapes.text_len - 5, short.shape[1])])
    [reference] = tiny_engine.generate([Request(prompt_embeds=padded, negative_prompt_embeds=neg, **request)])
    assert torch.equal(served.latents, reference.latents)
    assert text.status == "rejected" and "prompt: this engine was built without its text encoder" in text.error
    assert no_negative.status == "rejected" and "negative_prompt_embeds" in no_negative.error


def test_card_fields_nothing_read_are_gone(tiny_card):
    fields = set(type(tiny_card.shapes).model_fields)
    assert not {"text_dim", "spatial_multiple", "temporal_multiple"} & fields
    assert "capabilities" not in type(tiny_card).model_fields
    index = get_card("wan2.1-t2v-14b").pipeline_class
    assert index == "WanPipeline"


def test_the_saved_checkpoint_names_its_pipeline(tiny_checkpoint):
    assert json.loads((tiny_checkpoint / "model_index.json").read_text())["_class_name"] == "WanPipeline"
