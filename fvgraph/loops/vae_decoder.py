"""The decode step of a VAE whose config carries `latents_mean` / `latents_std` (Wan's, Qwen-Image's):
the latents are denormalized, decoded and mapped to [0, 1] (steps.VaeDecodeStep)."""

from __future__ import annotations

from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.denoise_loop import VAE_DECODE
from fvgraph.loops.loop_parts import Decoder
from fvgraph.loops.steps import VaeDecodeStep

VAE_DECODE_KIND = StepKind(VAE_DECODE, component="vae", phase="vae_decode", inputs={"latents": Role.STEP},
                           outputs={"video": Role.RESULT})  # fmt: skip
NORMALIZED_VAE_DECODER = Decoder(VAE_DECODE_KIND, lambda c: VaeDecodeStep(c.vae), VaeDecodeStep.postprocess)
