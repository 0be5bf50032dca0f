"""Triton kernel for fvgraph::guidance_euler: a 2-d grid of (block of latent elements, request).

Each program loads its request's guidance and dt once (scalars), then streams BLOCK elements of
latents, cond and uncond. Imported only when Triton is importable, or by the tests under
TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _guidance_euler_kernel(lat_ptr, cond_ptr, uncond_ptr, g_ptr, dt_ptr, out_ptr, N, BLOCK: tl.constexpr):
    b = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = b.to(tl.int64) * N  # B * N can pass 2^31 at video sizes
    g = tl.load(g_ptr + b).to(tl.float32)
    dt = tl.load(dt_ptr + b).to(tl.float32)
    lat = tl.load(lat_ptr + row + offs, mask=mask).to(tl.float32)
    c = tl.load(cond_ptr + row + offs, mask=mask).to(tl.float32)
    u = tl.load(uncond_ptr + row + offs, mask=mask).to(tl.float32)
    out = lat + dt * (u + g * (c - u))
    tl.store(out_ptr + row + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def guidance_euler_triton(latents, cond, uncond, guidance, dt) -> torch.Tensor:
    """Launches the kernel; returns what fvgraph::guidance_euler returns (contiguous, latents.dtype)."""
    b = latents.shape[0]
    n = latents[0].numel() if b else 0
    out = torch.empty(latents.shape, device=latents.device, dtype=latents.dtype)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n, BLOCK), b)  # blocks on axis 0: CUDA caps axis 1 at 65535
    _guidance_euler_kernel[grid](
        latents.contiguous(), cond.contiguous(), uncond.contiguous(), guidance.contiguous(), dt.contiguous(),
        out, n, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return out
