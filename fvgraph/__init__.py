"""fvgraph: a compiled runtime for video and image diffusion transformers.

    import fvgraph
    engine = fvgraph.Engine.from_card("tiny-wan")
    results = engine.generate([fvgraph.Request(prompt="a red fox", num_inference_steps=8, seed=0)])
    parallel = fvgraph.Engine.from_card("tiny-wan", parallel=fvgraph.ParallelConfig(cfg=2))  # docs/parallel.md
"""

from fvgraph.torchvision_notes import drop_torchvision_fallback_notes

drop_torchvision_fallback_notes()  # before the imports below raise them  # noqa: E402
from fvgraph.artifacts import ImageArtifact, LatentArtifact, Provenance, VideoArtifact  # noqa: E402
from fvgraph.card import ModelCard  # noqa: E402
from fvgraph.cards import card_names, get_card  # noqa: E402
from fvgraph.engine.engine import Engine  # noqa: E402
from fvgraph.events import PreviewEvent  # noqa: E402
from fvgraph.parallel.config import ParallelConfig  # noqa: E402
from fvgraph.request import Request, RequestRejected, Result  # noqa: E402

__all__ = ["Engine", "ImageArtifact", "LatentArtifact", "ModelCard", "ParallelConfig", "PreviewEvent", "Provenance", "Request",
           "RequestRejected", "Result", "VideoArtifact", "card_names", "get_card"]  # fmt: skip
__version__ = "0.1.0"
