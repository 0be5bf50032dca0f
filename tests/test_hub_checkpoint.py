"""A Hub repo id as the checkpoint: resolved through huggingface_hub's cache (HF_HUB_CACHE, offline with
HF_HUB_OFFLINE=1), the card picked from the id or the folder's pipeline class, the model given to the
CLI as its argument. The cache here is laid out by hand as huggingface_hub lays it out:
models--ORG--NAME/refs/main holding a commit, and snapshots/<commit>/ holding the files."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from fvgraph.card_for_checkpoint import card_for_checkpoint
from fvgraph.cards import all_cards, get_card
from fvgraph.cli import app
from fvgraph.engine.engine import Engine
from fvgraph.models.hub_checkpoint import CheckpointNotFound, hub_repo_id_of, local_checkpoint
from fvgraph.serving.model_names import ServedNames

REPO_ID = get_card("wan2.1-t2v-1.3b").hub_repos[0]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tiny_checkpoint, monkeypatch):
    """tiny-wan's checkpoint in a Hub cache under the released 1.3B card's repo id; offline."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(tiny_checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_every_released_card_names_its_repo_and_no_two_cards_share_one():
    published = [repo.lower() for card in all_cards() for repo in card.hub_repos]
    assert len(published) == len(set(published))
    for name in ("wan2.1-t2v-1.3b", "wan2.2-ti2v-5b", "flux.1-dev", "flux.1-schnell", "qwen-image"):
        assert get_card(name).hub_repos, name
    assert all(not card.hub_repos for card in all_cards() if card.embeds_weights)


def test_a_repo_id_resolves_to_its_snapshot_and_back(hub_cache):
    folder = local_checkpoint(REPO_ID)
    assert folder == hub_cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / COMMIT
    assert hub_repo_id_of(folder) == REPO_ID  # huggingface_hub's cache scan names the folder
    assert ServedNames.of("wan2.1-t2v-1.3b", (), folder).checkpoint == REPO_ID
    assert card_for_checkpoint(REPO_ID, folder).card_id == "wan2.1-t2v-1.3b"
    assert card_for_checkpoint(folder, folder).card_id == "wan2.1-t2v-1.3b"  # the folder's own id


def test_engine_from_card_takes_a_repo_id(hub_cache, tiny_engine):
    card = get_card("wan2.1-t2v-1.3b")
    fp32 = {name: spec.model_copy(update={"dtype": "fp32"}) for name, spec in card.components.items()}
    engine = Engine.from_card(card.model_copy(update={"components": fp32}), checkpoint=REPO_ID, device="cpu")
    assert type(engine.loop.components.transformer).__name__ == "WanTransformer3DModel"
    assert Engine.from_card(None, checkpoint=REPO_ID, device="cpu").card.card_id == "wan2.1-t2v-1.3b"


def test_an_id_missing_offline_is_one_line_naming_it_and_hf_hub_offline(hub_cache):
    with pytest.raises(CheckpointNotFound, match=r"'Wan-AI/Wan2.1-T2V-14B-Diffusers'.*HF_HUB_OFFLINE=1") as caught:
        Engine.from_card("wan2.1-t2v-14b", checkpoint="Wan-AI/Wan2.1-T2V-14B-Diffusers")
    assert "\n" not in str(caught.value)
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["generate", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "-O0"])
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert "Wan-AI/Wan2.1-T2V-14B-Diffusers" in line and "HF_HUB_OFFLINE" in line


def test_generate_takes_the_repo_id_as_its_model_with_no_card(hub_cache, tmp_path):
    out = tmp_path / "fox.gif"
    args = ["generate", REPO_ID, "-p", "a fox", "--steps", "2", "--frames", "5", "--height", "32", "--width", "32",
            "-O0", "--dtype", "fp32", "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "wan2.1-t2v-1.3b" in result.output and out.is_file()
    assert "random" not in result.output  # a checkpoint's weights: no noise note


def test_a_folder_the_weights_do_not_place_lists_the_candidate_cards(tiny_checkpoint, tmp_path):
    folder = tmp_path / "my-finetune"
    shutil.copytree(tiny_checkpoint, folder)
    with pytest.raises(ValueError, match="several cards serve: .*wan2.1-t2v-1.3b.*give --card"):
        card_for_checkpoint(folder, folder, "--card")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImagePipeline"}))
    assert card_for_checkpoint(folder, folder).card_id == "qwen-image"  # the one card serving the class


def test_serve_takes_the_repo_id_as_its_model(hub_cache, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "a fox", "request_id": "fox", "num_inference_steps": 1, "num_frames": 1,
                                    "height": 32, "width": 32}) + "\n")  # fmt: skip
    result = CliRunner().invoke(app, ["serve", REPO_ID, "-O0", "--dtype", "fp32", "--requests", str(requests),
                                      "-o", str(tmp_path / "out")])  # fmt: skip
    assert result.exit_code == 0, result.output
    [answer] = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert answer["request_id"] == "fox" and answer["status"] == "ok", answer
