"""What a family's projection layout (fvgraph/models/wan_projections.py) needs from a projection cache.

The cache itself, `ExactProjectionCache`, lives in fvgraph/runtime/projection_cache.py and satisfies
this protocol by its shape. The layouts cannot import it: runtime sits above models (runtime reaches
models through compile and loops), so a models -> runtime import would close a cycle. The layouts
name this protocol instead, and the engine hands them the runtime's cache.
"""

from __future__ import annotations

from typing import Callable, Hashable, Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class ProjectionCache(Protocol):
    """Exact reuse of conditioning projections: `prepare` a conditioning once, then `project` each
    projection that reads it. docs/projection_cache.md states the contract."""

    def prepare(self, conditioning: Tensor) -> None:
        """Compute `conditioning`'s key once, before the projections that read it."""
        ...

    def project(
        self, name: str, projection: nn.Module, conditioning: Tensor, compute: Callable[[], Tensor],
        variant: Callable[[], Hashable] | None = None,
    ) -> Tensor:
        """`compute()`'s output for `projection` applied to `conditioning`, reused while it holds."""
        ...
