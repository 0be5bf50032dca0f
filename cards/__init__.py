"""Model cards, one file per model family; this registry is how the runtime selects a card by name."""

from __future__ import annotations

import difflib

from fvgraph.card import ModelCard
from fvgraph.cards.flux import CARDS as _FLUX_CARDS
from fvgraph.cards.hunyuan_video15 import CARDS as _HUNYUAN_VIDEO15_CARDS
from fvgraph.cards.qwen_image import CARDS as _QWEN_IMAGE_CARDS
from fvgraph.cards.wan import CARDS as _WAN_CARDS
from fvgraph.cards.wan22 import CARDS as _WAN_2_2_CARDS
from fvgraph.cards.wan22_ti2v import CARDS as _WAN_2_2_TI2V_CARDS
from fvgraph.cards.wan_distill import CARDS as _WAN_DISTILL_CARDS
from fvgraph.cards.wan_i2v import CARDS as _WAN_I2V_CARDS

DEFAULT_CARD = "tiny-wan"
_REGISTRY: dict[str, ModelCard] = {card.card_id: card for card in (*_WAN_CARDS, *_WAN_I2V_CARDS, *_WAN_2_2_CARDS, *_WAN_2_2_TI2V_CARDS, *_WAN_DISTILL_CARDS, *_FLUX_CARDS,
                                                 *_QWEN_IMAGE_CARDS, *_HUNYUAN_VIDEO15_CARDS)}


class UnknownCardError(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def card_names() -> list[str]:
    return sorted(_REGISTRY)


def all_cards() -> list[ModelCard]:
    return [_REGISTRY[name] for name in card_names()]


def get_card(name: str) -> ModelCard:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name.lower(), card_names(), n=3, cutoff=0.6)
        if close:
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? (`fvgraph env` lists every card)"
        else:
            hint = f"known cards: {', '.join(card_names())}"
        raise UnknownCardError(f"unknown card {name!r}; {hint}") from None
