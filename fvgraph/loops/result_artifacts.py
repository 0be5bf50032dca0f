"""A finished request's typed artifacts (fvgraph/artifacts.py), built by the loop's `finalize`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fvgraph.artifacts import ImageArtifact, LatentArtifact, Provenance, VideoArtifact
from fvgraph.card import ModelCard
from fvgraph.loops.tiled_coding import VAE_DECODE


def artifacts(card: ModelCard, state, provenance: Mapping[str, Any], run_facts: Mapping[str, Any], latents: torch.Tensor,
              frames: np.ndarray | None) -> list[LatentArtifact | VideoArtifact | ImageArtifact]:  # fmt: skip
    """The latents (made by the last denoise step), then the decoded video, or images on an image card."""
    made = _provenance(provenance, run_facts, state.seed, "denoise", state.num_steps)
    out: list = [LatentArtifact(latents, made)]
    if frames is not None:
        decoded = _provenance(provenance, run_facts, state.seed, VAE_DECODE, None)
        out.append(ImageArtifact(frames, decoded) if card.shapes.max_frames == 1 else VideoArtifact(frames, card.fps, decoded))
    return out


def _provenance(given: Mapping[str, Any], run_facts: Mapping[str, Any], seed: int, produced_by: str, step: int | None) -> Provenance:
    return Provenance(
        card_id=given["card_id"], weights_version=given["weights_version"], precision=given["precision"],
        opt_level=int(run_facts.get("opt_level", 0)), parallel=str(run_facts.get("parallel", "single")), seed=seed,
        produced_by=produced_by, step=step, recipe=given["recipe"], adapters=given["loras"],
        adapter_digests=given["lora_digests"], merged_adapters=given["merged_loras"],
    )  # fmt: skip
