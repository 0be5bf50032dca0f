"""fvgraph: a compiled runtime for video and image diffusion transformers.

    import fvgraph
    engine = fvgraph.Engine.from_card("tiny-wan")
    results = engine.generate([fvgraph.Request(prompt="a red fox", num_inference_steps=8, seed=0)])
    parallel = fvgraph.Engine.from_card("tiny-wan", parallel=fvgraph.ParallelConfig(cfg=2))  # docs/parallel.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fvgraph.artifacts import ImageArtifact, LatentArtifact, Provenance, VideoArtifact
    from fvgraph.card import ModelCard
    from fvgraph.cards import card_names, get_card
    from fvgraph.engine.engine import Engine
    from fvgraph.events import PreviewEvent
    from fvgraph.parallel.config import ParallelConfig
    from fvgraph.request import Request, RequestRejected, Result

__all__ = ["Engine", "ImageArtifact", "LatentArtifact", "ModelCard", "ParallelConfig", "PreviewEvent", "Provenance", "Request",
           "RequestRejected", "Result", "VideoArtifact", "card_names", "get_card"]  # fmt: skip
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`fvgraph.ModelCard`, `fvgraph.Engine`, ...: imported from their module on first use (PEP 562), then
    kept. The package is the parent of every fvgraph module, the `fvgraph` command's included, so what
    it imports every command pays, `fvgraph --help` too: the card and request schemas hold tensors
    (torch), the engine brings the compiler and diffusers' model code (docs/architecture.md, "What
    loads when"; tests/test_light_import.py)."""
    if name == "Engine":
        from fvgraph.engine import engine as home
    elif name == "ModelCard":
        from fvgraph import card as home
    elif name == "ParallelConfig":
        from fvgraph.parallel import config as home
    elif name in ("Request", "RequestRejected", "Result"):
        from fvgraph import request as home
    elif name in ("card_names", "get_card"):
        from fvgraph import cards as home
    elif name in ("ImageArtifact", "LatentArtifact", "Provenance", "VideoArtifact"):
        from fvgraph import artifacts as home
    elif name == "PreviewEvent":
        from fvgraph import events as home
    else:
        raise AttributeError(f"module 'fvgraph' has no attribute {name!r}")
    value = globals()[name] = getattr(home, name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
