"""Qwen-Image-Edit: text_encode (Qwen2.5-VL, with the image) -> vae_encode (the image) -> denoise x N -> vae_decode.

As diffusers' QwenImageEditPipeline: the image is resized to about 1024^2 pixels at its own aspect ratio
(`calculate_dimensions`, multiples of 32), and that one image goes two ways. The vision-language
encoder reads it inside the pipeline's edit template: the image processor saved with the checkpoint
turns it into patches and a grid, and the template's `<|image_pad|>` is repeated once per merged patch,
as Qwen2VLProcessor expands it (that processor cannot be built without torchvision, its video half
needs it, so its image processor and tokenizer are loaded as saved and called as it calls them). The
VAE encodes it (the posterior's mode, normalised by latents_mean / latents_std), and its packed latents
join the latents' tokens in every denoise call with their own image shape in the rotary positions
(qwen_image_steps.QwenImageDenoiser). Everything else is Qwen-Image's: true CFG rescaled to the cond
prediction's norm, the schedule (shifted by the output's token count alone), the decode. The output
size is the request's height x width, the image's edit size for either one left out (the pipeline's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.denoise_loop import DENOISE, DENOISE_CFG, TEXT_ENCODE, DenoiseLoop
from fvgraph.loops.image_parts import ImageLatents
from fvgraph.loops.loop_parts import FamilyParts, LoopConfig
from fvgraph.loops.qwen_image_edit_steps import QwenEditEncodeStep, QwenEditTextEncodeStep
from fvgraph.loops.qwen_image_loop import QwenDenoising, QwenImageState, QwenText, qwen_denoise_kind
from fvgraph.loops.tiled_coding import VAE_ENCODE, VAE_ENCODE_KIND
from fvgraph.loops.vae_decoder import NORMALIZED_VAE_DECODER
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected

# QwenImageEditPipeline.__init__'s prompt_template_encode and prompt_template_encode_start_idx.
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
                 "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
                 "image that meets the user's requirements while maintaining consistency with the original input where "
                 "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
                 "<|im_start|>assistant\n")  # fmt: skip
EDIT_TEMPLATE_DROP = 64
EDIT_AREA = 1024 * 1024  # the pixel count calculate_dimensions aims the image at, whatever the output size

DENOISE_KINDS = {cfg: qwen_denoise_kind(name, cfg, media=("condition",)) for cfg, name in ((False, DENOISE), (True, DENOISE_CFG))}
TEXT_ENCODE_KIND = StepKind(TEXT_ENCODE, component="text_encoder", phase="text_encode",
                            inputs=dict.fromkeys(("input_ids", "attention_mask", "pixel_values", "image_grid_thw"), Role.STEP),
                            outputs={"embeds": Role.RESULT})  # fmt: skip


@dataclass
class QwenEditState(QwenImageState):
    """QwenImageState plus the image: its patches for the text encode (`pixel_values` [1, n * P, 1176],
    `image_grid_thw` [1, n, 3], one image per text), `image` [1, 3, H, W] in [-1, 1] until the VAE
    encodes it, then `condition`, its latents [1, C, 1, hc, wc]."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image: torch.Tensor | None = None
    condition: torch.Tensor | None = None


def edit_size(image: PIL.Image.Image) -> tuple[int, int]:
    """(height, width) the pipeline resizes the image to: about 1024^2 pixels at its aspect ratio, multiples of 32."""
    width, height, _ = calculate_dimensions(EDIT_AREA, image.size[0] / image.size[1])
    return height, width


class QwenEditText(QwenText):
    """Qwen-Image's texts, each read with the image by the vision-language encoder in the edit template.
    The pipeline cuts none of that prompt (its max_sequence_length only checks <= 1024), so neither does this."""

    kind = TEXT_ENCODE_KIND
    template, template_drop = EDIT_TEMPLATE, EDIT_TEMPLATE_DROP

    def __init__(self, card: ModelCard, components: Components, resizer: VaeImageProcessor):
        super().__init__(card, components)
        self.resizer = resizer
        tokenizer = components.tokenizer
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"  # as Qwen2VLProcessor picks it

    def build(self, components: Components) -> nn.Module:
        return QwenEditTextEncodeStep(components.text_encoder)

    def check(self, resolved: Request) -> None:
        if resolved.max_sequence_length != self.card.shapes.text_len:
            raise RequestRejected("max_sequence_length", f"card {self.card.card_id!r} cuts no text: QwenImageEditPipeline reads "
                                                         "the whole vision-language prompt (the image's tokens are part of "
                                                         "it); leave max_sequence_length unset")  # fmt: skip
        for field in ("prompt", "negative_prompt"):
            if self.image_token in (getattr(resolved, field) or ""):
                raise RequestRejected(field, f"must not contain {self.image_token!r}: the edit template places the image's tokens")

    def tokenize(self, state: QwenEditState, request: Request, texts: list[tuple[str, str]]) -> None:
        """As QwenImageEditPipeline's processor call, one row per text: the image processor on the resized
        image, the template's image token repeated grid.prod() // merge_size**2 times, then the tokenizer
        (right-padded: the rows take plain positions, so padding must follow each text)."""
        height, width = edit_size(request.image)
        image = self.resizer.resize(request.image, height, width)
        vision = self.components.image_processor(images=[image] * len(texts), return_tensors="pt")
        grid = vision["image_grid_thw"]
        merged = self.components.image_processor.merge_size ** 2
        prompts = [self.template.format(text).replace(self.image_token, self.image_token * int(grid[row].prod() // merged))
                   for row, (_, text) in enumerate(texts)]  # fmt: skip
        tokens = self.components.tokenizer(prompts, padding=True, padding_side="right", return_tensors="pt")
        kept = tokens.attention_mask.sum(dim=1) - self.template_drop  # each row's embeddings, as take_encoded keeps them
        row = int(kept.argmax())
        if kept[row] > self.card.shapes.text_len:
            field = texts[row][0].removesuffix("_embeds")  # prompt or negative_prompt
            raise RequestRejected(field, f"its vision-language prompt is {int(kept[row])} tokens with the image's, past the text "
                                         f"length of card {self.card.card_id!r} ({self.card.shapes.text_len}): shorten it")  # fmt: skip
        state.input_ids, state.attention_mask = tokens.input_ids, tokens.attention_mask
        state.pixel_values, state.image_grid_thw = vision["pixel_values"].unsqueeze(0), grid.unsqueeze(0)

    def encode_inputs(self, state: QwenEditState) -> dict[str, torch.Tensor]:
        device = self.components.device
        return {**super().encode_inputs(state), "pixel_values": state.pixel_values.to(device),
                "image_grid_thw": state.image_grid_thw.to(device)}  # fmt: skip

    def take_encoded(self, state: QwenEditState, result: StepResult) -> None:
        super().take_encoded(state, result)
        state.pixel_values = state.image_grid_thw = None

    def check_saved(self, checker: Any, state: QwenEditState) -> None:
        super().check_saved(checker, state)
        if state.phase == Phase.ENCODE:
            rows = len(state.encode_slots)
            grid = checker.tensor("image_grid_thw", shape=(1, rows, 3), floating=False)
            patches = checker.tensor("pixel_values", dims=3)
            if patches.shape[:2] != (1, int(grid.prod(dim=-1).sum())):
                checker.fail("pixel_values", f"must be [1, {int(grid.prod(dim=-1).sum())}, P] for its grid, got {list(patches.shape)}")


class QwenEditedImage:
    """The image to edit: required, resized as the pipeline resizes it, encoded once, then a constant."""

    phases = (Phase.VAE_ENCODE,)
    step_kinds = {VAE_ENCODE: VAE_ENCODE_KIND}
    reads = ("image",)
    device_fields = ("image", "condition")

    def __init__(self, card: ModelCard, components: Components, resizer: VaeImageProcessor):
        self.card, self.components, self.resizer = card, components, resizer
        self.dtype = components.transformer.dtype

    def build(self, components: Components) -> dict[str, nn.Module]:
        return {VAE_ENCODE: QwenEditEncodeStep(components.vae)}

    def check(self, resolved: Request) -> None:
        if resolved.image is None:
            raise RequestRejected("image", f"card {self.card.card_id!r} edits an image: pass image=...")

    def init_fields(self, request: Request, latents: torch.Tensor) -> dict[str, Any]:
        height, width = edit_size(request.image)
        image = self.resizer.preprocess(self.resizer.resize(request.image, height, width), height, width)
        return {"image": image.to(self.components.device, self.dtype)}  # the pipeline's image.to(prompt_embeds.dtype)

    def first_phase(self, state: QwenEditState) -> Phase | None:
        return Phase.VAE_ENCODE if state.image is not None else None

    def plan(self, state: QwenEditState) -> WorkPlan:
        return WorkPlan(state.request_id, VAE_ENCODE, {"image": state.image, "latents": state.latents})

    def take(self, state: QwenEditState, result: StepResult) -> None:
        state.condition, state.image = result["condition"].to(self.dtype), None
        state.phase = Phase.DENOISE

    def constants(self, state: QwenEditState) -> dict[str, torch.Tensor]:
        return {"condition": state.condition}

    def after_last_step(self, state: QwenEditState) -> None:
        state.condition = None

    def check_saved(self, state: QwenEditState) -> None:
        for name, dims in (("image", 4), ("condition", 5)):
            value = getattr(state, name)
            if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != dims or not value.is_floating_point()
                                      or not torch.isfinite(value).all()):  # fmt: skip
                raise ValueError(f"state of request {state.request_id!r}: {name}: must be a finite float tensor of {dims} dims")
        if state.phase == Phase.DENOISE and state.condition is None:
            raise ValueError(f"state of request {state.request_id!r}: condition: a denoising edit needs its image's latents")

    def warmup_inputs(self, height: int, width: int) -> dict[str, Any]:
        return {"image": torch.full((height, width, 3), 128, dtype=torch.uint8)}


class QwenEditDenoising(QwenDenoising):
    """Qwen-Image's denoiser with the edited image's tokens joined to the latents' (qwen_image_steps.QwenImageDenoiser)."""

    kinds = DENOISE_KINDS
    step_kinds = {DENOISE: DENOISE_KINDS[False], DENOISE_CFG: DENOISE_KINDS[True]}


class QwenImageEditLoop(DenoiseLoop):
    def __init__(self, card: ModelCard, components: Components, config: LoopConfig | None = None):
        # The pipeline's image_processor: VaeImageProcessor at the VAE's factor times the 2x2 packing.
        resizer = VaeImageProcessor(vae_scale_factor=components.facts.vae_spatial * 2)
        parts = FamilyParts("qwen_image_edit", QwenEditState, QwenEditText(card, components, resizer),
                            QwenEditDenoising(card, components), ImageLatents(card), NORMALIZED_VAE_DECODER,
                            QwenEditedImage(card, components, resizer))  # fmt: skip
        super().__init__(card, components, parts, config)

    def check_request(self, request: Request) -> Request:
        """The image's edit size for whichever of height and width the request leaves out, as the
        pipeline's `height or calculated_height`, `width or calculated_width`."""
        if request.image is not None and (request.height is None or request.width is None):
            height, width = edit_size(request.image)
            request = request.model_copy(update={"height": request.height or height, "width": request.width or width})
        return super().check_request(request)
