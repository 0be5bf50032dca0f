"""Which card serves a checkpoint when none is named, as `vllm serve MODEL` picks an architecture:

    1. the card that lists the checkpoint's Hub repo id in `hub_repos` (the id given, or the id of the
       Hub-cache snapshot a local folder is);
    2. else the one released card (one that loads its weights from a checkpoint) whose `pipeline_class`
       is the `_class_name` of the folder's model_index.json;
    3. else an error listing the candidates, asking for a card.

    card_for_checkpoint("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", folder)  -> the wan2.1-t2v-1.3b card
"""

from __future__ import annotations

import json
from pathlib import Path

from fvgraph.card import ModelCard
from fvgraph.cards import all_cards
from fvgraph.models.hub_checkpoint import hub_repo_id_of, looks_like_repo_id

__all__ = ["card_for_checkpoint", "cards_publishing"]


def cards_publishing(repo_id: str) -> list[ModelCard]:
    """The cards whose `hub_repos` name `repo_id` (the Hub's ids are case-insensitive)."""
    return [card for card in all_cards() if repo_id.lower() in (repo.lower() for repo in card.hub_repos)]


def card_for_checkpoint(checkpoint: str | Path, folder: Path, flag: str = "card") -> ModelCard:
    """The card for `checkpoint` (as given: a repo id or a folder) whose files are in `folder`;
    ValueError naming `flag` and the candidates when the weights do not say which."""
    repo_ids = [str(checkpoint)] if looks_like_repo_id(str(checkpoint)) else []
    if (cached := hub_repo_id_of(folder)) is not None:
        repo_ids.append(cached)
    for repo_id in repo_ids:
        if found := cards_publishing(repo_id):
            return found[0]
    index = folder / "model_index.json"
    try:
        pipeline = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        raise ValueError(f"checkpoint {str(checkpoint)!r}: no readable model_index.json in {folder}, so nothing says "
                         f"which card serves it; give {flag}") from None  # fmt: skip
    released = [card for card in all_cards() if not card.embeds_weights]
    candidates = [card for card in released if card.pipeline_class == pipeline]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        served = sorted({card.pipeline_class for card in released})
        raise ValueError(f"checkpoint {str(checkpoint)!r} is a {pipeline!r} folder, which no card serves "
                         f"(cards serve {', '.join(served)})")  # fmt: skip
    names = ", ".join(card.card_id for card in candidates)
    raise ValueError(f"checkpoint {str(checkpoint)!r} is a {pipeline} folder, which several cards serve: {names}; "
                     f"give {flag}")  # fmt: skip
