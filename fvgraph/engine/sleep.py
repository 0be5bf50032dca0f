"""Sleep and wake: the denoiser's weights leave the device and come back (the Engine's `sleep` and
`wake` delegate here), as vLLM's sleep mode gives a trainer the GPU between rollouts.

    engine.sleep(level=1)      # weights to host memory (pinned on CUDA)
    engine.sleep(level=2)      # weights discarded: host memory released too
    engine.wake()              # back, bit for bit, into the same Parameter objects

What sleeps is every parameter of the denoiser (both experts of a two-expert card); its buffers (the
rotary tables, -O3's FP8 copies: derived, not in a checkpoint) go to host memory at either level. The
text encoder and the VAE stay. Level 1 keeps a host copy of each parameter; level 2 keeps nothing but
each parameter's shape and dtype (a one-element placeholder expanded to the shape), and wake reloads
the weights the engine was built from: its checkpoint folder, or the card's seeded weights, in the
dtype the build chose (`fvgraph/models/components.py`'s `load_component`: the same loader, so the same
values), and the weights version is the build's again. `update_weights` while asleep is kept: at level
1 it writes the host copies, at level 2 it is held until wake, which takes those values over the
reloaded ones (and the version `update_weights` named).

The same Parameter objects get their storage back (`.data`), so every compiled step, whose graph
takes the weights as arguments, runs unchanged: nothing recompiles after wake. CUDA graphs read fixed
addresses, which wake cannot promise (the device storage was freed), so sleep drops every captured
graph and the pool they share, and each bucket captures again the first time it runs after wake
(`counters.graphs_dropped`, then `counters.captures`). The eager projection cache is emptied at sleep
(its entries are recomputed exactly).

Requests in flight at sleep, as `update_weights` treats them: `in_flight="finish"` (the default) runs
them to their end first, "stop" cancels them at their next step boundary (status 'cancelled'), and
"refuse" raises, changing nothing, while any is in flight. While asleep, starting or stepping a
request raises EngineAsleep (nothing is queued). Sleeping a sleeping engine raises EngineAsleep;
waking an awake engine is a no-op. Refused, before anything changes: a parallel engine (its worker
ranks hold their own weights), component offload (it already moves the weights: docs/memory.md), and
level 2 with merged LoRA adapters (a reload would lose the merge; level 1 keeps it).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from fvgraph.adapters.registry import AdapterRegistry
from fvgraph.card import ModelCard
from fvgraph.contract.loop import Loop, LoopState
from fvgraph.engine.in_flight import settle_in_flight
from fvgraph.models.components import load_component
from fvgraph.parallel.executor import ParallelExecutor
from fvgraph.runtime.block_streaming import BlockStreaming
from fvgraph.runtime.component_residency import ComponentResidency
from fvgraph.runtime.executor import CompiledExecutor, EagerExecutor
from fvgraph.runtime.projection_cache import ExactProjectionCache
from fvgraph.runtime.scheduler import Scheduler

DENOISERS = ("transformer", "transformer_2")


class EngineAsleep(RuntimeError):
    """The engine's denoiser weights are asleep (Engine.sleep): it runs no request until Engine.wake()."""


class RequestsInFlight(RuntimeError):
    """sleep(in_flight="refuse") while requests are in flight: nothing changed."""


class EngineSleep:
    """Handed the engine's card (what a level-2 wake reloads), loop (its components), executor (graphs
    to drop), eager projection cache, scheduler, component residency and adapters (what is refused),
    and the engine calls it drives, as WeightSync is: `live_states`, `refuse_in_tick(what, instead)`,
    `cancel(request_id)`, `tick(what)` and `drain`."""

    def __init__(self, card: ModelCard, loop: Loop, executor: EagerExecutor | CompiledExecutor | ParallelExecutor,
                 projection_cache: ExactProjectionCache | None, scheduler: Scheduler,
                 residency: ComponentResidency | BlockStreaming | None, adapters: AdapterRegistry | None,
                 live_states: Callable[[], list[LoopState]], refuse_in_tick: Callable[[str, str], None],
                 cancel: Callable[[str], bool], tick: Callable[[str], None], drain: Callable[[], None]):  # fmt: skip
        self._card, self._loop, self._executor, self._projection_cache = card, loop, executor, projection_cache
        self._scheduler, self._residency, self._adapters = scheduler, residency, adapters
        self._live_states, self._refuse_in_tick = live_states, refuse_in_tick
        self._cancel, self._tick, self._drain = cancel, tick, drain
        self._built_version = loop.components.weights_version  # what a level-2 wake reloads
        self.level: int | None = None  # None: awake
        self._host: dict[int, torch.Tensor] = {}  # level 1: id(parameter or buffer) -> its host copy
        self._held: dict[int, torch.Tensor] = {}  # level 2: id(parameter) -> update_weights' value, held for wake

    # -- what the engine asks ------------------------------------------------------------------------

    def refuse_while_asleep(self) -> None:
        if self.level is not None:
            raise EngineAsleep(f"the engine is asleep (engine.sleep(level={self.level})): it runs no requests; "
                               "call engine.wake() first")  # fmt: skip

    def value_device(self, parameter: torch.Tensor) -> torch.device:
        """Where update_weights puts a new value for `parameter` (the host while it is discarded)."""
        return torch.device("cpu") if id(parameter) in self._discarded() else parameter.device

    def write(self, parameter: torch.Tensor, value: torch.Tensor) -> None:
        """update_weights' copy: into the parameter (its host copy at level 1), or held until wake (level 2)."""
        if id(parameter) in self._discarded():
            self._held[id(parameter)] = value.clone(memory_format=torch.contiguous_format)  # not the caller's tensor
        else:
            parameter.copy_(value)

    # -- sleep and wake --------------------------------------------------------------------------------

    def sleep(self, level: int = 1, in_flight: Literal["finish", "stop", "refuse"] = "finish") -> dict:
        """Take the denoiser's weights off the device (level 1: to host memory; 2: discarded). Returns
        the level, the bytes that left the device, and what happened to the requests in flight."""
        self._refuse_in_tick("sleep", "sleep between ticks, after the callback returns")
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"level={level!r} must be 1 (weights to host memory) or 2 (weights discarded)")
        if in_flight not in ("finish", "stop", "refuse"):
            raise ValueError(f"in_flight={in_flight!r} must be 'finish', 'stop' or 'refuse'")
        if self.level is not None:
            raise EngineAsleep(f"the engine is already asleep (engine.sleep(level={self.level})); call engine.wake() "
                               "before sleeping again")  # fmt: skip
        self._check_supported(level)
        ids = [s.request_id for s in self._live_states()]
        if in_flight == "refuse" and ids:
            raise RequestsInFlight(f"sleep(in_flight='refuse'): {len(ids)} requests are in flight ({', '.join(ids[:3])}); "
                               "let them end, or sleep with in_flight='finish' or 'stop'")  # fmt: skip
        settle_in_flight(ids, in_flight == "stop", "sleep", self._cancel, self._scheduler.has_work, self._tick, self._drain)
        if isinstance(self._executor, CompiledExecutor) and self._executor.runner.cuda_graphs:
            self._executor.runner.drop_graphs()  # they read the addresses freed below
        if self._projection_cache is not None:
            self._projection_cache.clear()  # entries on the device, recomputed exactly after wake
        freed = self._put_to_sleep(level)
        self.level = level
        return {"level": level, "bytes": freed, "finished" if in_flight != "stop" else "stopped": ids}

    def wake(self) -> dict:
        """Put the denoiser's weights back on the device; a no-op on an awake engine."""
        self._refuse_in_tick("wake", "wake between ticks, after the callback returns")
        if self.level is None:
            return {"level": None, "version": self._loop.components.weights_version}
        level, components = self.level, self._loop.components
        device, updated = components.device, bool(self._held)
        reloaded = {}  # every reload done before any parameter is touched: a failed one leaves the engine asleep
        for name, module in self._denoisers():
            if level == 2 and any(id(p) not in self._held for p in module.parameters()):
                reloaded[name] = dict(load_component(self._card, name, components.checkpoint).named_parameters())
        for name, module in self._denoisers():
            fresh = reloaded.pop(name, None)
            for key, parameter in module.named_parameters():
                if level == 1:
                    parameter.data = self._host.pop(id(parameter)).to(device, copy=True)
                elif id(parameter) in self._held:
                    parameter.data = self._held.pop(id(parameter)).to(device, copy=True)
                else:
                    # As load_components placed it: on the device, and on a CPU out of the folder's memory map
                    # (its _own_storage: unaligned operands change the last bits of CPU BLAS results).
                    value = fresh.pop(key).detach().to(device)
                    parameter.data = value.clone() if components.checkpoint is not None and device.type == "cpu" else value
            for buffer in module.buffers():
                buffer.data = self._host.pop(id(buffer)).to(device, copy=True)
            del fresh
        if level == 2 and not updated:  # no update_weights while asleep: the build's weights again
            components.weights_version = self._built_version
        self._host.clear()
        self._held.clear()
        self.level = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies from pinned memory have landed
        return {"level": level, "version": components.weights_version}

    # -- helpers ---------------------------------------------------------------------------------------

    def _denoisers(self) -> list[tuple[str, nn.Module]]:
        components = self._loop.components
        return [(name, getattr(components, name)) for name in DENOISERS if getattr(components, name) is not None]

    def _discarded(self) -> set[int]:
        if self.level != 2:
            return set()
        return {id(p) for _, module in self._denoisers() for p in module.parameters()}

    def _check_supported(self, level: int) -> None:
        if isinstance(self._executor, ParallelExecutor):
            raise ValueError("sleep on a parallel engine is not supported: its worker ranks hold their own weights")
        if self._residency is not None:
            raise ValueError("sleep on an engine with offload is not supported: offload already keeps the weights in "
                             "host memory between their steps (docs/memory.md)")  # fmt: skip
        merged = [] if self._adapters is None else sorted(a.name for a in self._adapters.adapters.values() if a.slot is None)
        if level == 2 and merged:
            raise ValueError(f"sleep(level=2) would lose the merged LoRA adapters {merged} "
                             "(wake reloads the checkpoint's weights); use level=1, which keeps them")  # fmt: skip

    def _put_to_sleep(self, level: int) -> int:
        """Each denoiser parameter to a host copy (1) or a placeholder of its shape (2); buffers to host
        copies. Returns the bytes the parameters held on the device."""
        pin = self._loop.components.device.type == "cuda"
        freed = 0
        for _, module in self._denoisers():
            for parameter in module.parameters():
                freed += parameter.numel() * parameter.element_size()
                if level == 1:
                    self._host[id(parameter)] = _host_copy(parameter, pin)
                    parameter.data = self._host[id(parameter)]
                else:
                    # One host element expanded to the shape: update_weights still checks names and shapes against it.
                    parameter.data = torch.empty((), dtype=parameter.dtype).expand(parameter.shape)
            for buffer in module.buffers():
                self._host[id(buffer)] = _host_copy(buffer, pin)
                buffer.data = self._host[id(buffer)]
        if level == 2:
            gc.collect()  # a reference cycle may still hold a freed weight
            _return_freed_host_memory()
        if pin:
            torch.cuda.empty_cache()  # the freed device blocks back to the driver, for the trainer beside us
        return freed


def _host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy (pinned when the device is CUDA, so wake's copies are fast). On a CPU engine host and
    device are both the CPU and this is a real copy, as component offload's is, which is how the tests
    exercise the mechanism."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    copy.copy_(tensor.detach())
    return copy


def _return_freed_host_memory() -> None:
    """glibc keeps much of the freed heap for reuse instead of giving it back to the OS, so a level-2
    sleep's weights would still count in the process's RSS; malloc_trim(0) returns what it can. Measured
    on wan-cpu-bench (a 53.9 MB fp32 transformer) in a fresh process: RSS fell by 0.47x the
    transformer's bytes without it, 1.05x with it. A no-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return
    libc.malloc_trim(0)
