"""The check of a saved HunyuanVideo-1.5 state's texts (fvgraph/loops/state_check.py's checker): token ids of
both encoders while encoding, then each text's four tensors as the text encode step shapes them."""

from __future__ import annotations

from typing import Any

import torch

from fvgraph.contract.phase import Phase
from fvgraph.loops.state_check import EMBED_SLOTS
from fvgraph.models.components import Components


def _check_mask(checker: Any, name: str, length: int) -> None:
    mask = checker.tensor(name, shape=(1, length), floating=False)
    if mask.dtype != torch.int64 or not ((mask == 0) | (mask == 1)).all():
        checker.fail(name, f"must be int64 0/1, got {mask.dtype}")


def check_saved_texts(checker: Any, state: Any, components: Components, dtype: torch.dtype, lengths: tuple[int, int],
                      beside: dict[str, tuple[str, str, str]]) -> None:  # fmt: skip
    """`lengths`: (Qwen's tokens after the template prefix, ByT5's tokens); `beside`: each text's mask, ByT5 embeds and mask."""
    text_len, glyph_len = lengths
    needed = list(EMBED_SLOTS[: 2 if state.cfg else 1])
    if state.phase == Phase.ENCODE:
        if not isinstance(state.encode_slots, list) or not state.encode_slots or not set(state.encode_slots) <= set(needed):
            checker.fail("encode_slots", f"must list some of {needed}, got {state.encode_slots!r}")
        rows = len(state.encode_slots)
        ids = checker.tensor("input_ids", dims=2, floating=False)
        checker.tensor("attention_mask", shape=tuple(ids.shape), floating=False)
        checker.tensor("glyph_ids", shape=(rows, glyph_len), floating=False)
        checker.tensor("glyph_mask", shape=(rows, glyph_len), floating=False)
        if ids.shape[0] != rows:
            checker.fail("input_ids", f"must have {rows} rows, got {list(ids.shape)}")
        needed = [name for name in needed if name not in state.encode_slots]
    glyph_dim = components.text_encoder_2.config.d_model if components.text_encoder_2 is not None else None
    for name in needed:
        mask, glyph, glyph_mask = beside[name]
        for slot, shape in ((name, (1, text_len, components.facts.text_dim)), (glyph, (1, glyph_len, glyph_dim))):
            embeds = checker.tensor(slot, dims=3)
            if tuple(embeds.shape) != shape and not (shape[2] is None and embeds.shape[:2] == shape[:2]):
                checker.fail(slot, f"must be {list(shape)}, got {list(embeds.shape)}")
            if embeds.dtype != dtype:
                checker.fail(slot, f"must be {dtype}, got {embeds.dtype}")
        _check_mask(checker, mask, text_len)
        _check_mask(checker, glyph_mask, glyph_len)
