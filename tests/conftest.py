"""Shared fixtures: one tiny-wan engine per session, tiny checkpoints written with save_pretrained."""

from __future__ import annotations

import os

import pytest
import torch

# Compiled artifacts of a test run stay in a folder the run owns.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ.get("PYTEST_TMPDIR", "/tmp"), "fvgraph-test-inductor"))

from fvgraph.cards import get_card  # noqa: E402
from fvgraph.engine.engine import Engine  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_card():
    return get_card("tiny-wan")


@pytest.fixture(scope="session")
def tiny_engine():
    return Engine.from_card("tiny-wan", device="cpu")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_engine, tiny_card):
    """tiny-wan's weights as a users' diffusers folder, with sharded safetensors and their index."""
    folder = tmp_path_factory.mktemp("tiny-wan-checkpoint")
    return tiny_engine.loop.components.save_pretrained(folder, tiny_card, max_shard_size="50KB")


def embeds(seed: int, card, n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text_dim = card.components["transformer"].config["text_dim"]  # a seeded card: its weights' width
    return [torch.randn(1, card.shapes.text_len, text_dim, generator=g) for _ in range(n)]
