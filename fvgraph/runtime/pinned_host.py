"""Weights moved into pinned host memory, packed into chunks, one tensor at a time.

    pin_in_place(list(transformer.blocks.parameters()), pin=True)   # each now a view into a pinned chunk

torch's pinned allocations (`Tensor.pin_memory()`, `torch.empty(..., pin_memory=True)`) round every
request up to a power of two: a Wan 14B feed-forward weight (141.6 MB in bf16) takes 256 MB, a whole
block about 1.46x its bytes. Packed into chunks of `CHUNK_BYTES` (a power of two: nothing is rounded
but a component's last chunk), the host holds the weights' bytes and the chunks' unused tails.
Each tensor is copied into its place and pointed at it (`.data`) before the next one is copied, so
the host holds at most one tensor twice. Offload's two mechanisms use it on CUDA
(fvgraph/runtime/component_residency.py, fvgraph/runtime/block_streaming.py).
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 30
ALIGN = 512  # each tensor starts at a multiple of this many bytes in its chunk (any dtype's alignment)


def pin_in_place(tensors: list[torch.Tensor], pin: bool = True, chunk_bytes: int = CHUNK_BYTES) -> list[torch.Tensor]:
    """Point each of `tensors` (host tensors, each once) at a copy in a chunk of host memory (pinned
    when `pin`; a tensor larger than a chunk gets an allocation of its own), in order. Returns the copies."""
    sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
    copies, chunk, used = [], None, 0
    for index, (tensor, size) in enumerate(zip(tensors, sizes)):
        if size == 0:  # nothing to place
            place = torch.empty(0, dtype=torch.uint8)
        elif size > chunk_bytes:
            place = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        else:
            if chunk is None or used + size > chunk.numel():
                remaining = sum(s for s in sizes[index:] if s <= chunk_bytes)  # a component's last chunk: no larger than needed
                chunk, used = torch.empty(min(chunk_bytes, remaining), dtype=torch.uint8, pin_memory=pin), 0
            place, used = chunk[used : used + size], used + size
        copy = place[: tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor.detach())
        tensor.data = copy
        copies.append(copy)
    return copies


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
