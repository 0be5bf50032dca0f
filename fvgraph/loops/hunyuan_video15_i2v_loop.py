"""The HunyuanVideo-1.5 image-to-video loop: text_encode -> image_encode -> vae_encode -> denoise x N -> vae_decode.

The text-to-video loop's parts (fvgraph/loops/hunyuan_video15_loop.py: the texts, the guided denoiser,
the schedule, the decoder) plus the image's (`HunyuanFirstFrame`, fvgraph/loops/hunyuan_video15_image.py),
as diffusers' HunyuanVideo15ImageToVideoPipeline: SigLIP's embeddings as the denoiser's image tokens and
the image's latents on frame 0 with a mask in the [latents, cond latents, mask] channels, both request
constants of every denoise step (and of both CFG branches). A request that gives neither height nor
width runs at the image's bucket, as the pipeline always does; one may give both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fvgraph.card import ModelCard
from fvgraph.contract.step_kind import Role
from fvgraph.loops.denoise_loop import DenoiseLoop
from fvgraph.loops.hunyuan_video15_image import HunyuanFirstFrame, image_bucket
from fvgraph.loops.hunyuan_video15_loop import DECODER, DENOISE_KINDS, HunyuanDenoiser, HunyuanLatents, HunyuanText, HunyuanVideo15State
from fvgraph.loops.hunyuan_video15_recipe import card_for_weights
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected

LOOP = "hunyuan_video15_i2v"
# The text-to-video kinds with the image's two request constants.
IMAGE_DENOISE_KINDS = {cfg: replace(kind, inputs={**kind.inputs, "condition": Role.CONSTANT, "image_embeds": Role.CONSTANT})
                       for cfg, kind in DENOISE_KINDS.items()}  # fmt: skip


@dataclass
class HunyuanVideo15I2VState(HunyuanVideo15State):
    """The text-to-video state plus the image: its inputs until encoded, then the encoded values."""

    siglip_pixels: torch.Tensor | None = None  # [1, 3, S, S] the feature extractor's, until image_encode ran
    image: torch.Tensor | None = None  # [1, 3, H, W] in [-1, 1], until vae_encode ran
    image_embeds: torch.Tensor | None = None  # [1, N, D'] SigLIP's last hidden state
    condition: torch.Tensor | None = None  # [1, C + 1, F, h, w] the image's latents on frame 0, then the mask


class HunyuanVideo15ImageToVideoLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        if components.text_encoder is None:
            raise ValueError(f"card {card.card_id!r} encodes its texts itself (four tensors per text; prompt_embeds are not "
                             "taken): build its engine with the text encoders (text_encoder=True)")  # fmt: skip
        card = card_for_weights(card, components)  # the folder's shift, guidance scale and default size
        self.target_size = int(components.transformer.config.target_size)
        image = HunyuanFirstFrame(card, components)  # refuses a build without the image encoder
        siglip = components.image_encoder.config  # SigLIP's tokens: the image stream every denoiser call carries
        denoiser = HunyuanDenoiser(card, IMAGE_DENOISE_KINDS, image_tokens=(siglip.image_size // siglip.patch_size) ** 2)
        parts = FamilyParts(LOOP, HunyuanVideo15I2VState, HunyuanText(card, components), denoiser, HunyuanLatents(card), DECODER, image)
        super().__init__(card, components, parts, config)

    def check_request(self, request: Request) -> Request:
        """The image's bucket where the request gives no size (HunyuanVideo15ImageToVideoPipeline's size)."""
        if request.image is not None and request.height is None and request.width is None:
            height, width = image_bucket(request.image, self.target_size, self.spatial_scale)
            request = request.model_copy(update={"height": height, "width": width})
        elif (request.height is None) != (request.width is None):
            missing = "width" if request.width is None else "height"
            raise RequestRejected(missing, f"card {self.card.card_id!r} runs at the image's bucket unless a request gives "
                                           "height and width together: give both, or neither")  # fmt: skip
        return super().check_request(request)
