"""Placing a loaded module on the engine's device, except the parts offload holds in host memory.

    place_on_device(transformer, torch.device("cuda"), held=(transformer.blocks,))

Offload (fvgraph/runtime/offload.py) says which parts of a component stay in host memory from the
load on: a whole component under `offload="components"`, a transformer's blocks under
`offload="blocks:N"`. Those are never materialized on the device whole; the offload mechanism moves
them there a component or a group of blocks at a time. Everything else goes as `module.to(device)`
would put it (each module's own tensors through `nn.Module._apply`, the function `.to` uses).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

HostParts = Callable[[str, nn.Module], tuple[nn.Module, ...]]  # component name, module -> the parts held in host memory


def place_on_device(module: nn.Module, device: torch.device, held: tuple[nn.Module, ...] = ()) -> nn.Module:
    """`module` with every parameter and buffer outside the `held` submodules (and theirs) on `device`."""
    if not held:
        return module.to(device)
    kept = {id(m) for part in held for m in part.modules()}
    for submodule in module.modules():
        if id(submodule) not in kept:
            submodule._apply(lambda t: t.to(device), recurse=False)
    return module
