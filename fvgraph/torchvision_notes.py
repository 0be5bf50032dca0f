"""transformers 5 says, when an image processor class is first imported, that it "requires torchvision
(not installed); falling back to ..." PIL. fvgraph needs no torchvision, and the modules a card loads
import such classes (diffusers' FLUX and Qwen-Image pipeline modules, an image-to-video card's image
processor), so without this every command that builds those cards began with lines of noise. The filter
goes in where a card's modules load (ComponentSpec.resolve_class, the loop registry), not at `import
fvgraph`: it imports transformers, which a light import leaves out. Only those notes are dropped;
transformers' other warnings (weights not loaded, say) still show."""

from __future__ import annotations

import logging


class _DropTorchvisionFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed)" not in record.getMessage()


def drop_torchvision_fallback_notes() -> None:
    """Filter those notes out at transformers' own handlers (records from its child loggers reach them)."""
    from transformers.utils import logging as transformers_logging

    for handler in transformers_logging._get_library_root_logger().handlers:
        if not any(isinstance(f, _DropTorchvisionFallback) for f in handler.filters):
            handler.addFilter(_DropTorchvisionFallback())
