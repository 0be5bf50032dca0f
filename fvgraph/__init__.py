"""fvgraph: a compiled runtime for video and image diffusion transformers.

    import fvgraph
    engine = fvgraph.Engine.from_card("tiny-wan")
    results = engine.generate([fvgraph.Request(prompt="a red fox", num_inference_steps=8, seed=0)])
    parallel = fvgraph.Engine.from_card("tiny-wan", parallel=fvgraph.ParallelConfig(cfg=2))  # docs/parallel.md
"""

from fvgraph.card import ModelCard
from fvgraph.cards import card_names, get_card
from fvgraph.engine.engine import Engine
from fvgraph.parallel.config import ParallelConfig
from fvgraph.request import Request, RequestRejected, Result

__all__ = ["Engine", "ModelCard", "ParallelConfig", "Request", "RequestRejected", "Result", "card_names", "get_card"]
__version__ = "0.1.0"
