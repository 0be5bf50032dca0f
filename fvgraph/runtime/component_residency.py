"""Component offload: each component's weights live in host memory and are on the device only while
a step that reads them runs. Applied from outside the model code, as diffusers' model CPU offload is,
by pointing each parameter's and buffer's `.data` at a host or a device tensor: the module objects,
and so every compiled step's parameter list, stay the same objects.

    residency = ComponentResidency(components.modules(), steps, device, ledger)
    with residency.around("denoise_cfg"):   # the executors do this around every group they run
        step(**inputs)

- Which components a step kind reads is found once, by identity, among its step module's submodules
  (FLUX's text_encode reads both text encoders).
- Before a group runs, every component its kind does not read leaves the device (a device copy that
  was changed in place, e.g. by `update_weights`, is copied back to the host first), then the ones it
  reads come in. Host copies are pinned on CUDA (packed: fvgraph/runtime/pinned_host.py); on a CPU
  engine host and device are both the CPU and a move is a real copy, which is how the tests exercise
  this code.
- Components with the same tensor layout that no kind reads together (the two experts of Wan 2.2
  A14B) share one device slot: the expert that takes over is copied into the storage the other one
  used, so both experts' compiled steps (and CUDA graphs) read fixed addresses. On a CUDA-graphed
  engine a slot whose kinds are captured (the denoiser's) keeps its storage and its occupant when
  other components' steps run: its graphs read those addresses.
- Prefetch: when the scheduler's arrangement of a tick (fvgraph/runtime/residency_order.py) says the
  next group reads other components, their copies are issued right after this group is launched, on
  a side stream on CUDA (the compute stream waits on its event before the group that reads them), so
  they overlap this group's kernels; an arena shared with the running component is written only
  after its kernels (the side stream waits for the compute stream first). On a CPU the same calls
  copy at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from fvgraph.runtime.offload import ResidencyLedger
from fvgraph.runtime.pinned_host import pin_in_place


@dataclass
class DeviceSlot:
    """Device storage one component at a time occupies (experts of one layout share one)."""

    members: tuple[str, ...]
    fixed: bool = False  # CUDA graphs read its addresses: it is never freed, and its occupant stays
    storage: list[torch.Tensor] | None = None
    occupant: str | None = None
    versions: list[int] = field(default_factory=list)  # the occupant's tensors' _version as copied in
    ready: object | None = None  # the CUDA event its last copy in recorded (None: ready)


class ComponentResidency:
    def __init__(self, modules: dict[str, object], steps: dict[str, nn.Module], device: torch.device,
                 ledger: ResidencyLedger, graphed_kinds: frozenset[str] = frozenset()):  # fmt: skip
        self.device, self.ledger = device, ledger
        modules = {name: m for name, m in modules.items() if isinstance(m, nn.Module)}
        self.kind_components = {kind: _reads(step, modules) for kind, step in steps.items()}
        self._tensors = {name: _tensors(m) for name, m in modules.items()}
        self._nbytes = {name: sum(t.numel() * t.element_size() for t in ts) for name, ts in self._tensors.items()}
        # Everything starts in host memory (loaded there: fvgraph/models/placement.py); on CUDA each
        # tensor is swapped for its pinned copy at once, so the host never holds a component twice.
        pin = device.type == "cuda"
        self._host = {name: pin_in_place(ts) if pin else [_to_host(t) for t in ts] for name, ts in self._tensors.items()}
        fixed = set().union(*(self.kind_components[k] for k in graphed_kinds if k in self.kind_components))
        self._slot_of: dict[str, DeviceSlot] = {}
        for members in _shared_slots(self._tensors, self.kind_components.values()):
            slot = DeviceSlot(members, fixed=any(name in fixed for name in members))
            self._slot_of.update(dict.fromkeys(members, slot))
        self._copies = _Copies(device)
        self.upcoming: list[str] = []  # this tick's kinds in run order, as the scheduler arranged them
        self._depth = 0
        ledger.planned_peak = self.planned_peak_bytes()

    @property
    def resident(self) -> dict[str, int]:
        """Component -> bytes it holds on the device now."""
        return {slot.occupant: self._nbytes[slot.occupant] for slot in self._slots() if slot.occupant is not None}

    def planned_peak_bytes(self) -> int:
        """The most weight bytes this can hold on the device at once, bounded from its plan: the slots
        that never leave (a graphed expert slot), the largest step's other components, and one
        component prefetched for the next group (what admission charges, fvgraph/serving/memory_reservation.py)."""
        size = {id(slot): max(self._nbytes[name] for name in slot.members) for slot in self._slots()}
        fixed = sum(size[id(slot)] for slot in self._slots() if slot.fixed)
        moving = [slot for slot in self._slots() if not slot.fixed]
        step = max((sum(size[id(s)] for s in {id(self._slot_of[n]): self._slot_of[n] for n in names}.values() if not s.fixed)
                    for names in self.kind_components.values()), default=0)  # fmt: skip
        return fixed + step + max((size[id(slot)] for slot in moving), default=0)

    def components_of(self, kind: str) -> frozenset[str]:
        return self.kind_components.get(kind, frozenset())

    @contextlib.contextmanager
    def around(self, kind: str) -> Iterator[None]:
        """Make `kind`'s components resident (recorded as one step in the ledger), run the block, then
        prefetch what the tick's next group reads. Nested calls (an executor falling back to another)
        act once."""
        self._depth += 1
        try:
            if self._depth == 1:
                self.before(kind)
            yield
            if self._depth == 1:
                self._prefetch_next(kind)
        finally:
            self._depth -= 1

    def before(self, kind: str) -> None:
        needed = self.components_of(kind)
        for slot in self._slots():
            if slot.occupant is not None and slot.occupant not in needed and not slot.fixed:
                self._vacate(slot, keep_storage=any(name in needed for name in slot.members))  # a sibling moves in
        for name in needed:
            self._bring_in(name)
        for name in needed:
            self._copies.wait(self._slot_of[name])
        self.ledger.step(kind, self.resident)

    def _prefetch_next(self, kind: str) -> None:
        if self.upcoming and self.upcoming[0] == kind:
            self.upcoming.pop(0)
        if self.upcoming:
            running = self.components_of(kind)
            for name in self.components_of(self.upcoming[0]) - running:
                if not (self._slot_of[name].occupant in running):  # never overwrite the running component's slot
                    self._bring_in(name)

    def _bring_in(self, name: str) -> None:
        slot = self._slot_of[name]
        if slot.occupant == name:
            return
        if slot.occupant is not None:  # the other expert of a shared slot: its storage is reused
            self._vacate(slot, keep_storage=True)
        host = self._host[name]
        with self._copies.side():
            if slot.storage is None:
                slot.storage = [h.to(self.device, non_blocking=True, copy=True) for h in host]
            else:
                for dev, h in zip(slot.storage, host):
                    dev.copy_(h, non_blocking=True)
        slot.ready = self._copies.record()
        tensors = self._tensors[name]
        for t, dev in zip(tensors, slot.storage):
            t.data = dev
        slot.occupant, slot.versions = name, [t._version for t in tensors]
        self.ledger.moved(name, self._nbytes[name], into_device=True)

    def _vacate(self, slot: DeviceSlot, keep_storage: bool) -> None:
        """The occupant goes back to its host copy (copied back first where changed on the device)."""
        name, tensors = slot.occupant, self._tensors[slot.occupant]
        self._copies.wait(slot)
        for t, host, version in zip(tensors, self._host[name], slot.versions):
            if t._version != version:  # written in place while resident (update_weights, a LoRA slot)
                host.copy_(t.data)
                self.ledger.written_back[name] += host.numel() * host.element_size()
        for t, host in zip(tensors, self._host[name]):
            t.data = host
        slot.occupant, slot.versions = None, []
        if not keep_storage and not slot.fixed:
            slot.storage = None
        self.ledger.moved(name, self._nbytes[name], into_device=False)

    def _slots(self) -> list[DeviceSlot]:
        return list({id(slot): slot for slot in self._slot_of.values()}.values())


class _Copies:
    """Where copies to the device run: a side stream and its events on CUDA; at once on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # after what reads the slot now
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> object | None:
        return self.stream.record_event() if self.cuda else None

    def wait(self, slot: DeviceSlot) -> None:
        """The compute stream waits for the slot's copy; its storage is marked used there."""
        if slot.ready is None:
            return
        compute = torch.cuda.current_stream(self.stream.device)
        compute.wait_event(slot.ready)
        for tensor in slot.storage:
            tensor.record_stream(compute)
        slot.ready = None


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` pointed at its host copy (on a CPU engine, the tensor itself), which is returned."""
    host = tensor.detach().to("cpu")
    tensor.data = host
    return host


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers, each once."""
    return list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())


def _reads(step: nn.Module, modules: dict[str, nn.Module]) -> frozenset[str]:
    inside = {id(m) for m in step.modules()}
    return frozenset(name for name, module in modules.items() if id(module) in inside)


def _shared_slots(tensors: dict[str, list[torch.Tensor]], reads: object) -> list[tuple[str, ...]]:
    """Components grouped by tensor layout; a group shares one slot unless some kind reads two of it."""
    by_layout: dict[tuple, list[str]] = {}
    for name, ts in tensors.items():
        by_layout.setdefault(tuple((tuple(t.shape), t.dtype) for t in ts), []).append(name)
    together = [set(r) for r in reads]
    slots = []
    for names in by_layout.values():
        if len(names) > 1 and not any(len(r & set(names)) > 1 for r in together):
            slots.append(tuple(names))
        else:
            slots += [(name,) for name in names]
    return slots
