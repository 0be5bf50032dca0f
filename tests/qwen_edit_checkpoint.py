"""What the Qwen-Image-Edit reference tests share: tiny-qwen-image-edit's seeded weights written by
QwenImageEditPipeline.save_pretrained, and diffusers' pipeline loaded back from that folder with the
processor the checkpoint keeps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers import QwenImageEditPipeline
from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor

from fvgraph.cards import get_card
from fvgraph.models.components import diffusers_scheduler, load_components
from reference_helpers import reference_pipeline


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """transformers' own Qwen2VLProcessor, built without its video processor: the constructor checks every
    part's class, and the check of the video processor's needs torchvision, which the CPU setup lacks.
    Everything an image prompt runs (the image processor, the image-token expansion, the tokenizer) is
    transformers' code as it is. (diffusers' own tests load a tiny processor from the Hub instead, which
    an offline test cannot.)"""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def edit_image(seed: int, h: int, w: int) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def save_tiny_edit_checkpoint(folder: Path) -> Path:
    """tiny-qwen-image-edit's seeded weights written by QwenImageEditPipeline.save_pretrained, and its
    processor laid out as the released checkpoint keeps it: processor/ with the image processor and the
    tokenizer (each written by its own save_pretrained), listed in model_index.json as Qwen2VLProcessor."""
    card = get_card("tiny-qwen-image-edit")
    c = load_components(card, None, torch.device("cpu"))
    QwenImageEditPipeline(scheduler=diffusers_scheduler(card.recipe.sampler), vae=c.vae, text_encoder=c.text_encoder,
                          tokenizer=c.tokenizer, processor=None, transformer=c.transformer).save_pretrained(folder)  # fmt: skip
    c.image_processor.save_pretrained(folder / "processor")
    c.tokenizer.save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen2VLProcessor"]}))
    return folder


def edit_reference_pipeline(checkpoint: Path) -> QwenImageEditPipeline:
    """QwenImageEditPipeline from the saved folder: weights of its own, the saved processor's parts."""
    saved = checkpoint / "processor"
    processor = ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(saved),
                                          tokenizer=AutoTokenizer.from_pretrained(saved), video_processor=None)  # fmt: skip
    return reference_pipeline(QwenImageEditPipeline, checkpoint, processor=processor)
