"""Block offload (`offload="blocks:N"`): a Wan transformer's blocks live in host memory (pinned on CUDA)
and run from two fixed device slots of N blocks each, used alternately; the next group is copied in
while this one runs. Applied from outside the model code, as component offload is.

    streaming = BlockStreaming({"transformer": transformer}, steps, modules, device, blocks=2, ledger)
    with streaming.around("denoise_cfg"):   # the executors do this around every group they run
        step(**inputs)

- Each block's parameters point at their host copy; its `forward` is rebound (an instance attribute,
  as fvgraph/models/wan_projections.py does) to run the original forward with the parameters
  re-pointed at its slot's tensors (`_reparametrize_module`, what `torch.func.functional_call` uses).
- The first block of group g waits for g's copy (`fvgraph::wait_group`) and issues g+1's into the
  other slot (`fvgraph::fetch_group`, fvgraph/contract/block_copies.py); the first block of all
  issues group 0's first. Group g+1's slot was last read by group g-1, whose kernels were launched
  before the copy is: on CUDA the copy stream waits for them.
- The slots are buffers of a module attached to the transformer (`block_streaming`), so a compiled
  step takes them as arguments at fixed addresses: it compiles once and replays as a CUDA graph.
  Experts of one block layout share the slots (no step reads two experts).
- The ledger records, for each group run, what is resident (the components, the transformer's other
  weights, the slots) and, per block group, the copies made while it ran: counted by the copy op
  itself into a counter on the device (scalar adds that a CUDA graph captures and replays), read after
  the group ran (on CUDA, one wait for the device per group run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from fvgraph.contract import block_copies  # noqa: F401  (registers torch.ops.fvgraph.fetch_group / wait_group)
from fvgraph.runtime.offload import DENOISERS, ResidencyLedger
from fvgraph.runtime.pinned_host import pin_in_place

SLOTS = 2  # one group runs from a slot while the next is copied into the other


class BlockSlots(nn.Module):
    """The fixed device tensors streamed blocks run from: `slots` sets of `blocks` blocks each."""

    def __init__(self, layout: list[torch.Tensor], blocks: int, slots: int, device: torch.device):
        super().__init__()
        self.per_block, self.blocks, self.slots = len(layout), blocks, slots
        for slot in range(slots):
            for position in range(blocks):
                for i, t in enumerate(layout):
                    self.register_buffer(_slot_name(slot, position, i), torch.empty_like(t, device=device), persistent=False)

    def tensors(self, slot: int, positions: int) -> list[torch.Tensor]:
        """The first `positions` blocks' tensors of `slot`, read through the module (so a traced step
        reads its arguments)."""
        return [getattr(self, _slot_name(slot, p, i)) for p in range(positions) for i in range(self.per_block)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


def _slot_name(slot: int, position: int, index: int) -> str:
    return f"slot{slot}_block{position}_{index}"


class StreamedBlocks(nn.Module):
    """One transformer's blocks streamed in groups of `group_size` through shared `slots`."""

    def __init__(self, blocks: nn.ModuleList, group_size: int, slots: BlockSlots, device: torch.device):
        super().__init__()
        self.slots = slots
        self.group_size = group_size
        self.groups = -(-len(blocks) // group_size)
        # Per group: fetches, tensors, bytes; on the device, so a replayed CUDA graph counts its copies too.
        self.register_buffer("copies", torch.zeros(self.groups, 3, dtype=torch.int64, device=device), persistent=False)
        self._blocks = tuple(blocks)  # not a child module: the blocks stay the transformer's alone
        host = [t for block in blocks for _, t in _named_tensors(block)]  # the block's own tensors are its host copy
        if device.type == "cuda":  # pinned, for copies that overlap kernels (loaded in host memory already)
            pin_in_place(host)
        for index, block in enumerate(blocks):
            names = tuple(name for name, _ in _named_tensors(block))
            block.forward = _StreamedForward(self, index, block, names)

    def group_of(self, index: int) -> tuple[int, int]:
        return divmod(index, self.group_size)

    def group_blocks(self, group: int) -> range:
        return range(group * self.group_size, min((group + 1) * self.group_size, len(self._blocks)))

    def slot_tensors(self, group: int) -> list[torch.Tensor]:
        return self.slots.tensors(group % self.slots.slots, len(self.group_blocks(group)))

    def enter_group(self, group: int) -> None:
        """Before the group's first block: wait for its copy, and issue the next group's."""
        if group == 0:
            self._fetch(0)
        torch.ops.fvgraph.wait_group(self.slot_tensors(group))
        if group + 1 < self.groups:
            self._fetch(group + 1)

    def _fetch(self, group: int) -> None:
        # Read through the blocks, so a traced step copies from its arguments.
        host = [t for index in self.group_blocks(group) for _, t in _named_tensors(self._blocks[index])]
        torch.ops.fvgraph.fetch_group(self.slot_tensors(group), host, self.copies, group)

    def group_name(self, group: int) -> str:
        blocks = self.group_blocks(group)
        return f"blocks.{blocks[0]}" if len(blocks) == 1 else f"blocks.{blocks[0]}-{blocks[-1]}"


class _StreamedForward:
    """A block's forward run from its slot: installed as the block's instance `forward`."""

    def __init__(self, streamed: StreamedBlocks, index: int, block: nn.Module, names: tuple[str, ...]):
        self.streamed, self.names = streamed, names
        self.group, self.position = streamed.group_of(index)
        self.original = type(block).forward.__get__(block)
        self.block = block

    def __call__(self, *args, **kwargs):
        if self.position == 0:
            self.streamed.enter_group(self.group)
        slot = self.streamed.slot_tensors(self.group)
        mine = slot[self.position * len(self.names) : (self.position + 1) * len(self.names)]
        with _reparametrize_module(self.block, dict(zip(self.names, mine))):
            return self.original(*args, **kwargs)


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


class BlockStreaming:
    """Block offload of an engine's Wan transformers; the executors run every group `around` its kind."""

    def __init__(self, modules: dict[str, object], device: torch.device, group_size: int, ledger: ResidencyLedger,
                 card_id: str):  # fmt: skip
        self.ledger = ledger
        modules = {name: m for name, m in modules.items() if isinstance(m, nn.Module)}
        denoisers = {name: modules[name] for name in DENOISERS if name in modules}
        shared: dict[tuple, BlockSlots] = {}
        self.streamed: dict[str, StreamedBlocks] = {}
        for name, transformer in denoisers.items():
            layout = _check_blocks(transformer, name, group_size, card_id)
            groups = -(-len(transformer.blocks) // group_size)
            key = (tuple((tuple(t.shape), t.dtype) for t in layout), group_size)
            if key not in shared:
                shared[key] = BlockSlots(layout, group_size, min(SLOTS, groups), device)
            streamed = StreamedBlocks(transformer.blocks, group_size, shared[key], device)
            transformer.block_streaming = streamed
            self.streamed[name] = streamed
        self.resident = _resident_bytes(modules, self.streamed, list(shared.values()))
        ledger.planned_peak = sum(self.resident.values())
        ledger.held_from_build = ledger.planned_peak  # none of it leaves the device

    @contextlib.contextmanager
    def around(self, kind: str) -> Iterator[None]:
        """Run the block, then record it as one step: what is resident, and the block groups it copied."""
        before = {name: s.copies.clone() for name, s in self.streamed.items()}
        yield
        for name, streamed in self.streamed.items():
            made = streamed.copies - before[name]
            for group in range(streamed.groups):
                fetches, tensors, nbytes = made[group].tolist()
                if fetches:
                    self.ledger.moved(f"{name}.{streamed.group_name(group)}", nbytes, True, moves=fetches, tensors=tensors)
        self.ledger.step(kind, self.resident)


def _check_blocks(transformer: nn.Module, name: str, group_size: int, card_id: str) -> list[torch.Tensor]:
    """One block's tensors, after checking that the transformer's blocks can be streamed in groups of N."""
    blocks = getattr(transformer, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"offload='blocks:{group_size}': card {card_id!r}'s {name} ({type(transformer).__name__}) has "
                         'no `blocks` list to stream (block offload runs Wan transformers); offload="components" '
                         "moves whole components")  # fmt: skip
    if group_size > len(blocks):
        raise ValueError(f"offload='blocks:{group_size}': N must be at most the number of transformer blocks "
                         f"({len(blocks)} in card {card_id!r}'s {name})")  # fmt: skip
    layouts = {tuple((n, tuple(t.shape), t.dtype) for n, t in _named_tensors(b)) for b in blocks}
    if len(layouts) != 1:
        raise ValueError(f"offload='blocks:{group_size}': card {card_id!r}'s {name} has blocks of different "
                         "layouts; block offload streams blocks of one layout through fixed slots")  # fmt: skip
    return [t for _, t in _named_tensors(blocks[0])]


def _resident_bytes(modules: dict[str, nn.Module], streamed: dict[str, StreamedBlocks],
                    slots: list[BlockSlots]) -> dict[str, int]:  # fmt: skip
    """Component -> its bytes on the device: all of each component but a streamed transformer's blocks
    (its copy counter included); the slots apart."""
    resident = {}
    for name, module in modules.items():
        skip = set()
        if name in streamed:
            skip = {id(t) for block in streamed[name]._blocks for _, t in _named_tensors(block)}
            skip |= {id(t) for t in streamed[name].slots.buffers()}
        tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if id(t) not in skip}
        resident[name] = sum(t.numel() * t.element_size() for t in tensors.values())
    resident["block_slots"] = sum(s.nbytes for s in slots)
    return resident
