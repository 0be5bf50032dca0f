"""The copies of block offload as custom ops: a compiled step calls them as single opaque nodes, so
fullgraph capture holds, the passes cannot drop or reorder them, and a CUDA graph captures them.

    torch.ops.fvgraph.fetch_group(slot, host, copies, group)   # host weights of `group` -> `slot`
    torch.ops.fvgraph.wait_group(slot)                          # the compute stream waits for that copy

On CUDA `fetch_group` copies on the device's copy stream, which first waits for the compute stream (the
kernels that last read `slot` were launched before the fetch), and `wait_group` makes the compute
stream wait for the copy stream: a fork and a join, which stream capture records into the graph. On a
CPU both run at once and the copy is a real copy into the slot.

Both declare `slot` mutated, so in a compiled graph every read of the slot comes after them. `copies`
([groups, 3] int64 on the slots' device: fetches, tensors, bytes per group) is counted by in-place
scalar adds on the compute stream: kernels on CUDA, which a captured graph replays, so its replays
count their copies as -O0 and -O1 do.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def copy_stream(device_index: int) -> torch.cuda.Stream:
    """The process's copy stream of one CUDA device: the ops take tensors only, and `fetch_group` and
    `wait_group` must use the same stream (as torch keeps one default stream per device)."""
    return torch.cuda.Stream(torch.device("cuda", device_index))


@torch.library.custom_op("fvgraph::fetch_group", mutates_args=("slot", "copies"))
def fetch_group(slot: list[torch.Tensor], host: list[torch.Tensor], copies: torch.Tensor, group: int) -> None:
    if slot[0].is_cuda:
        side = copy_stream(slot[0].device.index)
        side.wait_stream(torch.cuda.current_stream(slot[0].device))  # after the kernels that read this slot last
        with torch.cuda.stream(side):
            for device_tensor, host_tensor in zip(slot, host, strict=True):
                device_tensor.copy_(host_tensor, non_blocking=True)
    else:
        for device_tensor, host_tensor in zip(slot, host, strict=True):
            device_tensor.copy_(host_tensor)
    copies[group, 0] += 1
    copies[group, 1] += len(host)
    copies[group, 2] += sum(t.numel() * t.element_size() for t in host)


@fetch_group.register_fake
def _(slot, host, copies, group) -> None:
    return None


@torch.library.custom_op("fvgraph::wait_group", mutates_args=("slot",))
def wait_group(slot: list[torch.Tensor]) -> None:
    if slot[0].is_cuda:
        torch.cuda.current_stream(slot[0].device).wait_stream(copy_stream(slot[0].device.index))


@wait_group.register_fake
def _(slot) -> None:
    return None
