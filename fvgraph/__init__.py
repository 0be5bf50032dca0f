"""fvgraph: a compiled runtime for video and image diffusion transformers.

    import fvgraph
    engine = fvgraph.Engine.from_card("tiny-wan")
    results = engine.generate([fvgraph.Request(prompt="a red fox", num_inference_steps=8, seed=0)])
    parallel = fvgraph.Engine.from_card("tiny-wan", parallel=fvgraph.ParallelConfig(cfg=2))  # docs/parallel.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fvgraph.card import ModelCard
from fvgraph.cards import card_names, get_card
from fvgraph.parallel.config import ParallelConfig
from fvgraph.request import Request, RequestRejected, Result

if TYPE_CHECKING:
    from fvgraph.engine.engine import Engine

__all__ = ["Engine", "ModelCard", "ParallelConfig", "Request", "RequestRejected", "Result", "card_names", "get_card"]
__version__ = "0.1.0"


def __getattr__(name: str) -> type:
    """`fvgraph.Engine`, imported on first use: the engine brings the compiler (dynamo, inductor) and
    diffusers' model and scheduler code, which `import fvgraph` and `fvgraph --help` should not load
    (tests/test_light_import.py). Making an engine is the point where they are used."""
    if name == "Engine":
        from fvgraph.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'fvgraph' has no attribute {name!r}")
