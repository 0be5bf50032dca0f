"""The two denoise step kinds of TaylorSeer (fvgraph/loops/taylor_seer.py): a full step that also
returns each CFG branch's noise prediction (the features the Taylor factors are formed from), and a
forecast step that runs no transformer: each branch's noise prediction is the Taylor series of its
kept factors at the request's step distance.

The features are the noise predictions rather than `proj_out`'s output, which diffusers' lite mode
keeps: one is the other reshaped and permuted, and the series is elementwise, so the forecast is the
same numbers. The forecast's coefficients d**k / k! enter as a per-row [B, orders] tensor, never a
Python number, so requests at different distances share one graph; the number of orders (1 ..
max_order + 1) is fixed by the step's inputs, one signature each.

The full step marks its two denoiser calls as CFG branches, as the plain step does, so the CFG
fusion pass runs them as one batch at -O1; whether a step keeps or forecasts is fixed when the
module is built, never decided per call.
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.compile.markers import mark_request_constant
from fvgraph.loops.samplers import FlowEulerSampler, UniPCSampler
from fvgraph.loops.steps import DenoiseStep


class TaylorDenoiseStep(DenoiseStep):
    """A whole denoise step that keeps (`forecast=False`: outputs "features_0" cond, "features_1"
    uncond) or forecasts (`forecast=True`: inputs "taylor_{branch}_{order}" and "taylor_coeffs")."""

    def __init__(self, transformer: nn.Module, sampler: FlowEulerSampler | UniPCSampler, cfg: bool, forecast: bool):
        super().__init__(transformer, sampler, cfg)
        self.forecast = forecast
        self.num_branches = 2 if cfg else 1

    def forward(
        self,
        latents: torch.Tensor,  # [B, C, F, H, W] float32
        timestep: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, L, D]
        coeffs: torch.Tensor,  # [B, num_coeffs]
        negative_prompt_embeds: torch.Tensor | None = None,
        guidance_scale: torch.Tensor | None = None,
        taylor_coeffs: torch.Tensor | None = None,  # [B, orders] float32 when forecasting: d**k / k!
        **extra: torch.Tensor,  # sampler history carry_0..; when forecasting, taylor_{b}_{k} ([B, C, F, H, W] each)
    ) -> dict[str, torch.Tensor]:
        # 1. each branch's noise prediction: the denoiser, or the Taylor series of its factors
        dtype = prompt_embeds.dtype  # the denoiser's compute dtype (its input is cast to it)
        texts = (prompt_embeds, negative_prompt_embeds)
        noises = []
        for b, branch in enumerate(("cond", "uncond")[: self.num_branches]):
            if self.forecast:
                noises.append(self._series([extra[f"taylor_{b}_{k}"] for k in range(taylor_coeffs.shape[1])], taylor_coeffs, dtype))
            else:  # marked as a CFG branch, as the plain step's: at -O1 the fusion pass runs both as one batch
                noises.append(self._denoise(branch, latents.to(dtype), timestep, mark_request_constant(texts[b])))
        noise = self._guided(noises[0], noises[1], guidance_scale) if self.cfg else noises[0]
        # 2. the sampler update
        out = self._sampler_step(latents, noise, extra, coeffs)
        if not self.forecast:
            out.update({f"features_{b}": n for b, n in enumerate(noises)})
        return out

    @staticmethod
    def _series(factors: list[torch.Tensor], taylor_coeffs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """sum_k F_k * c_k in `dtype`, term by term as diffusers' TaylorSeerState.predict adds them: each
        product in float32 (where a scalar multiply of a low-precision tensor computes) rounded to `dtype`."""
        out = torch.zeros_like(factors[0], dtype=dtype)
        for k, factor in enumerate(factors):
            c = taylor_coeffs[:, k].view(-1, *([1] * (factor.dim() - 1)))
            out = out + (factor.to(dtype).float() * c).to(dtype)
        return out
