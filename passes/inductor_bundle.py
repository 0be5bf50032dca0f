"""The one CustomGraphPass for inductor's `post_grad_custom_post_pass`: empty today (every fvgraph pass
is an FX pass), so the compiler installs nothing; it installs the bundle once it has a member.

Inductor takes a single pass per hook (torch 2.11), so every inductor-level rewrite (pattern
fusions, kernel swaps) would go through this bundle, in order. Its uuid hashes each member's source and
config: inductor folds it into the FX graph cache key, and a pass without a uuid would silently
disable that cache.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

InductorPass = Callable[[torch.fx.Graph], None]


class InductorPassBundle(CustomGraphPass):
    def __init__(self, passes: Sequence[InductorPass] = ()):
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for inductor_pass in self.passes:
            inductor_pass(graph)

    def uuid(self) -> str:
        digest = hashlib.sha256(b"fvgraph-inductor-bundle")
        for inductor_pass in self.passes:
            owner = inductor_pass if inspect.isfunction(inductor_pass) else type(inductor_pass)
            digest.update(inspect.getsource(owner).encode())
            digest.update(repr(getattr(inductor_pass, "config", None)).encode())
        return digest.hexdigest()[:16]

    def __bool__(self) -> bool:
        return bool(self.passes)
