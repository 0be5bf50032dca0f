"""Cards load users' diffusers folders (model_index.json, sharded safetensors); nothing downloads."""

import json

import pytest
import torch

from fvgraph.cards import get_card
from fvgraph.models.components import CheckpointError
from fvgraph.engine.engine import Engine
from fvgraph.request import Request


def test_checkpoint_folder_has_diffusers_layout(tiny_checkpoint):
    index = json.loads((tiny_checkpoint / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert (tiny_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert (tiny_checkpoint / "scheduler" / "scheduler_config.json").is_file()


def test_loaded_checkpoint_generates_what_the_seeded_card_does(tiny_engine, tiny_checkpoint):
    loaded = Engine.from_card("tiny-wan", checkpoint=tiny_checkpoint, device="cpu")
    request = Request(prompt="a glass of water", seed=4, num_inference_steps=3, num_frames=5)
    ours, theirs = loaded.generate([request])[0], tiny_engine.generate([request])[0]
    assert torch.equal(ours.latents, theirs.latents)


def test_released_card_loads_a_local_folder_with_its_layout(tiny_checkpoint):
    """wan2.1 cards take their weights from a folder; here the folder holds tiny weights of the same classes."""
    card = get_card("wan2.1-t2v-1.3b")
    dit = card.components["transformer"]
    tiny = dit.model_copy(update={"dtype": "fp32"})
    card = card.model_copy(update={"components": {**card.components, "transformer": tiny}})
    engine = Engine.from_card(card, checkpoint=tiny_checkpoint, device="cpu")
    assert type(engine.loop.components.transformer).__name__ == "WanTransformer3DModel"


def test_missing_checkpoint_pieces_are_named(tmp_path, tiny_checkpoint):
    with pytest.raises(CheckpointError, match="model_index.json not found"):
        Engine.from_card("tiny-wan", checkpoint=tmp_path)
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="expects folder .*transformer"):
        Engine.from_card("tiny-wan", checkpoint=tmp_path)
    with pytest.raises(CheckpointError, match="pass checkpoint="):
        Engine.from_card("wan2.1-t2v-14b")
