"""Classifier-free guidance combine + flow-matching Euler update, in one pass over the latents.

    new_latents = latents + dt * (uncond + g * (cond - uncond))        g, dt: [B], one per request

This is DenoiseStep's guidance combine followed by FlowEulerSampler.update (fvgraph/steps.py,
fvgraph/samplers.py: `sample + dt * model_output`, dt = sigma_next - sigma per request). Eager runs it
as ~5 elementwise kernels over the latents; the Triton kernel reads latents, cond and uncond once and
writes the result once. The math is in fp32 throughout (DenoiseStep combines in the noise dtype, bf16
on a GPU, before the fp32 update: this op is the more precise of the two); the output is in
latents.dtype.
"""

import torch

from fvgraph.kernels._triton import use_triton


def _check(latents: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, guidance: torch.Tensor, dt: torch.Tensor):
    """cond / uncond shaped like latents [B, ...]; guidance and dt are [B] (per request)."""
    for name, t in (("cond", cond), ("uncond", uncond)):
        if t.shape != latents.shape:
            raise ValueError(f"guidance_euler: {name} must have latents' shape {tuple(latents.shape)}, got {tuple(t.shape)}")
    b = latents.shape[0] if latents.dim() else 0
    for name, t in (("guidance", guidance), ("dt", dt)):
        if t.shape != (b,):
            raise ValueError(f"guidance_euler: {name} must be [B]=[{b}] (one per request), got {tuple(t.shape)}")


def guidance_euler_reference(latents, cond, uncond, guidance, dt) -> torch.Tensor:
    """The torch reference, in fp32."""
    per_row = (-1,) + (1,) * (latents.dim() - 1)
    g = guidance.float().view(per_row)
    noise = uncond.float() + g * (cond.float() - uncond.float())
    return (latents.float() + dt.float().view(per_row) * noise).to(latents.dtype)


@torch.library.custom_op("fvgraph::guidance_euler", mutates_args=())
def guidance_euler(
    latents: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, guidance: torch.Tensor, dt: torch.Tensor
) -> torch.Tensor:
    """latents + dt * (uncond + guidance * (cond - uncond)), per-request guidance / dt [B]."""
    _check(latents, cond, uncond, guidance, dt)
    if use_triton("guidance_euler", latents, cond, uncond, guidance, dt):
        from fvgraph.kernels.guidance_euler_triton import guidance_euler_triton

        return guidance_euler_triton(latents, cond, uncond, guidance, dt)
    return guidance_euler_reference(latents, cond, uncond, guidance, dt).contiguous()  # as the fake promises


@guidance_euler.register_fake
def _(latents, cond, uncond, guidance, dt):
    return torch.empty_like(latents, memory_format=torch.contiguous_format)
