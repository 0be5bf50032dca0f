"""Which card and which weights a command runs, from MODEL, --card and --checkpoint, as `vllm serve MODEL`:

    fvgraph generate                                        tiny-wan, its embedded (random) weights
    fvgraph generate wan2.1-t2v-1.3b --checkpoint DIR       a card name, its weights from DIR
    fvgraph generate Wan-AI/Wan2.1-T2V-1.3B-Diffusers       a Hub repo id: the card that publishes it
    fvgraph generate /models/my-wan-finetune --card ...     a local diffusers folder

MODEL is a card name when one is called so (or when it has no "/" and is no folder here), else a checkpoint. A checkpoint is resolved to local files
before anything loads (fvgraph/models/hub_checkpoint.py), and with no card named, the card is the one
its repo id or pipeline class picks (fvgraph/card_for_checkpoint.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:  # the card schema brings torch, which `fvgraph --help` must not load
    from fvgraph.card import ModelCard

MODEL_ARGUMENT = typer.Argument(None, metavar="MODEL", show_default=False,
                                help="A card name, a Hub repo id or a local diffusers folder (default: tiny-wan).")  # fmt: skip
CARD_OPTION = typer.Option(None, "--card", help="Card name (`fvgraph env` lists them). Default: the card MODEL or "
                           "--checkpoint names, else tiny-wan.")  # fmt: skip
CHECKPOINT_OPTION = typer.Option(None, "--checkpoint", help="The card's weights: a Hub repo id (its cache first, a "
                                 "download unless HF_HUB_OFFLINE=1) or a local diffusers folder.")  # fmt: skip
# The command that runs a real model, where an embedded card's output would be taken for one.
REAL_MODEL_EXAMPLE = "fvgraph generate Wan-AI/Wan2.1-T2V-1.3B-Diffusers -p \"a red fox\""


@dataclass(frozen=True)
class ModelChoice:
    card: ModelCard
    checkpoint: str | None = None  # as given: a repo id or a folder (what the server's names read)
    folder: Path | None = None  # where its files are on this machine

    @property
    def random_weights(self) -> bool:
        """An embedded card run without a checkpoint: seeded random weights, whose output is noise."""
        return self.folder is None and self.card.embeds_weights

    def random_weights_note(self) -> str | None:
        """The one line a command prints when it runs random weights (None otherwise)."""
        if not self.random_weights:
            return None
        return (f"note: {self.card.card_id} has random (seeded) weights, so its output is noise: it checks the pipeline, "
                f"not a model. A real model: {REAL_MODEL_EXAMPLE}")  # fmt: skip


def choose_model(model: Optional[str], card: Optional[str], checkpoint: Optional[str]) -> ModelChoice:
    """The card and local weights MODEL / --card / --checkpoint name; ValueError naming the flag."""
    from fvgraph.card_for_checkpoint import card_for_checkpoint
    from fvgraph.cards import DEFAULT_CARD, card_names, get_card
    from fvgraph.models.hub_checkpoint import local_checkpoint

    if model is not None:
        # A name with no "/" that is no folder here reads as a card (a misspelt one gets "did you mean").
        if model in card_names() or ("/" not in model and not Path(model).exists()):
            if card is not None and card != model:
                raise ValueError(f"MODEL {model!r} and --card {card!r} name two cards: give one")
            card = model
        elif checkpoint is not None and checkpoint != model:
            raise ValueError(f"MODEL {model!r} and --checkpoint {checkpoint!r} name two checkpoints: give one")
        else:
            checkpoint = model
    if checkpoint is None:
        return ModelChoice(get_card(card or DEFAULT_CARD))
    folder = local_checkpoint(checkpoint)
    if card is not None:
        return ModelChoice(get_card(card), checkpoint, folder)
    return ModelChoice(card_for_checkpoint(checkpoint, folder, "--card"), checkpoint, folder)
