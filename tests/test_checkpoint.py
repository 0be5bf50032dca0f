"""Cards load users' diffusers folders (model_index.json, sharded safetensors); nothing downloads."""

import json
import shutil

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
    (tmp_path / "model_index.json").write_text((tiny_checkpoint / "model_index.json").read_text())
    with pytest.raises(CheckpointError, match="expects folder .*transformer"):
        Engine.from_card("tiny-wan", checkpoint=tmp_path)
    with pytest.raises(CheckpointError, match="has no embedded weights: give its checkpoint"):
        Engine.from_card("wan2.1-t2v-14b")


def _edited_copy(tiny_checkpoint, tmp_path, relative: str, **changes):
    """A copy of the tiny checkpoint whose JSON file `relative` has `changes` applied."""
    folder = tmp_path / "edited"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / relative).read_text())
    (folder / relative).write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize(("relative", "changes", "named"), [
    ("transformer/config.json", {"num_layers": 1}, "transformer.*27 stored weights config.json has no place for"),
    ("transformer/config.json", {"num_layers": 3}, "transformer.*weights config.json declares but the files lack"),
    ("vae/config.json", {"num_res_blocks": 2}, "'vae'.*weights config.json declares but the files lack"),
    ("vae/config.json", {"base_dim": 16}, "'vae'.*does not load into AutoencoderKLWan.*expected shape"),
    ("text_encoder/config.json", {"num_layers": 3}, "'text_encoder'.*declares but the files lack"),
])  # fmt: skip
def test_a_config_that_disagrees_with_its_weights_is_refused_naming_the_component(tiny_checkpoint, tmp_path,
                                                                                 relative, changes, named):  # fmt: skip
    folder = _edited_copy(tiny_checkpoint, tmp_path, relative, **changes)
    with pytest.raises(CheckpointError, match=named):
        Engine.from_card("tiny-wan", checkpoint=folder, device="cpu")


def test_a_component_the_card_does_not_load_is_refused_not_dropped(tiny_checkpoint, tmp_path):
    folder = _edited_copy(tiny_checkpoint, tmp_path, "model_index.json",
                          transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)  # fmt: skip
    shutil.copytree(folder / "transformer", folder / "transformer_2")
    with pytest.raises(CheckpointError, match="lists component 'transformer_2'.*card 'tiny-wan' does not load"):
        Engine.from_card("tiny-wan", checkpoint=folder, device="cpu")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "transformer_2": [None, None]}))
    assert Engine.from_card("tiny-wan", checkpoint=folder, device="cpu").facts.experts == ("transformer",)


@pytest.mark.parametrize(("text", "named"), [
    ("garbage {", "not readable JSON"),
    ("[1, 2]", "must be a JSON object with a string '_class_name'"),
    ('{"transformer": ["diffusers", "WanTransformer3DModel"]}', "must be a JSON object with a string '_class_name'"),
    ('{"_class_name": "WanPipeline", "transformer": 5}', "component 'transformer' must be \\[library, class\\]"),
    ('{"_class_name": "WanPipeline", "vae": ["diffusers", "AutoencoderKLWan"]}', "does not list component 'transformer'"),
    ('{"_class_name": "WanPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKLWan"]}',
     "component 'transformer' is 'FluxTransformer2DModel', card 'tiny-wan' loads 'WanTransformer3DModel'"),
])  # fmt: skip
def test_a_garbage_model_index_is_refused_naming_what_is_wrong(tiny_checkpoint, tmp_path, text, named):
    folder = tmp_path / "garbage"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "model_index.json").write_text(text)
    with pytest.raises(CheckpointError, match=named):
        Engine.from_card("tiny-wan", checkpoint=folder, device="cpu")
