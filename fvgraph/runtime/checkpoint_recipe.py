"""What a diffusers checkpoint folder says about its recipe, set beside the card's.

A folder carries the scheduler's `flow_shift` (scheduler/scheduler_config.json) and the pipeline's
`boundary_ratio` and `expand_timesteps` (model_index.json). The engine runs the card's recipe (with
what `recipe=` chose over it); where the folder says otherwise, loading warns with both values and
how to run the folder's, and `fvgraph env --card ... --checkpoint ...` lists every value and where
it comes from.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fvgraph.card import ModelCard

log = logging.getLogger(__name__)

# key -> (file in the folder, how recipe= / the CLI sets it; None: the card's loop decides it)
_SOURCES = {
    "flow_shift": ("scheduler/scheduler_config.json", "recipe={'flow_shift': ...} or --flow-shift"),
    "boundary_ratio": ("model_index.json", "recipe={'boundary_ratio': ...} or --boundary-ratio"),
    "expand_timesteps": ("model_index.json", None),
}


@dataclass(frozen=True)
class RecipeValue:
    """One recipe value: what the run uses, what the checkpoint says (None: it says nothing)."""

    key: str
    used: Any
    checkpoint: Any
    source: str  # the file of the folder that holds it

    @property
    def differs(self) -> bool:
        if self.checkpoint is None:
            return False
        if isinstance(self.used, float) and isinstance(self.checkpoint, (int, float)) and not isinstance(self.checkpoint, bool):
            return not math.isclose(self.used, self.checkpoint, rel_tol=1e-9)
        return self.used != self.checkpoint

    def __str__(self) -> str:
        said = "says nothing" if self.checkpoint is None else f"says {self.checkpoint!r}"
        return f"{self.key}: the run uses {self.used!r}; the checkpoint's {self.source} {said}"


def _read(folder: Path, name: str) -> dict:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else {}


def recipe_values(card: ModelCard, checkpoint: str | Path) -> list[RecipeValue]:
    """Each recipe value the run uses beside what the checkpoint folder says of it."""
    folder = Path(checkpoint)
    files = {name: _read(folder, name) for name, _ in _SOURCES.values()}
    used = card.recipe_in_effect()
    return [RecipeValue(key, used[key], files[name].get(key), name) for key, (name, _) in _SOURCES.items()]


def warn_recipe_differences(card: ModelCard, checkpoint: str | Path) -> list[RecipeValue]:
    """Log a warning for each value where the checkpoint says otherwise than the run; returns them."""
    differing = [value for value in recipe_values(card, checkpoint) if value.differs]
    for value in differing:
        how = _SOURCES[value.key][1]
        if card.recipe.step_distilled and value.key == "flow_shift":
            remedy = f"recipe {card.recipe.name!r} fixes its schedule (fvgraph/recipe.py)"
        else:
            remedy = f"to run the checkpoint's, pass {how}" if how else f"card {card.card_id!r}'s loop decides it"
        log.warning("checkpoint %s: %s (card %r); %s", checkpoint, value, card.card_id, remedy)
    return differing
