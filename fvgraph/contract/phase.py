"""Where a request's loop stands: one phase of the driven loop, named once for every loop.

A loop moves its state through these in order: its texts are encoded, its media conditioning (if
any) is encoded, the denoise steps run, the latents are decoded. A loop declares which of the
optional phases it adds (`image_encode`, `vae_encode`); the runtime never reads a phase.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """A str enum: it saves as its plain value and compares equal to it ("denoise" == Phase.DENOISE)."""

    ENCODE = "encode"  # the request's texts still to encode
    IMAGE_ENCODE = "image_encode"  # image conditioning: its image-encoder embeddings
    VAE_ENCODE = "vae_encode"  # media conditioning: its VAE latents
    DENOISE = "denoise"
    DECODE = "decode"
    DONE = "done"
