"""Step previews (Request.preview_every, docs/previews.md): the loop side.

After every k-th denoise step and after the last, a request that asks gets its denoised estimate x0
drawn small by the card's latent-to-RGB map (fvgraph/latent_rgb.py), as a PreviewEvent the engine
hands to `on_preview`. The x0 comes from what the step returned, never from another launch: UniPC's
update returns it as the newest history entry (`carry_1`), and an Euler or re-noising update is solved
for it from the step's input and output latents (samplers.py `denoised`). Only the middle latent frame
is taken, and only at a preview step of a request that asked, so the step's graph is the same with
previews or without (one compile, bit-identical results) and a request without previews copies
nothing to the host. After the last step the preview is drawn from the final latents themselves.
"""

from __future__ import annotations

import torch

from fvgraph.card import ModelCard
from fvgraph.events import PreviewEvent
from fvgraph.latent_rgb import LatentRgbMap, fit_latent_rgb
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected


class LoopPreviews:
    """The card's latent-to-RGB map (published, or fitted once from a seeded card's VAE on first use)
    and each preview step's image."""

    def __init__(self, card: ModelCard, components: Components, decode_step):
        self.card, self.components = card, components
        self._decode_step = decode_step  # () -> the loop's whole-latents decode step (for a fit)
        self._map: LatentRgbMap | None = None

    @property
    def available(self) -> str | None:
        """Why this card gives no previews, or None when it does."""
        if self.card.latent_rgb is None and not self.card.embeds_weights:
            return f"card {self.card.card_id!r} states no latent-to-RGB map (card field latent_rgb) to draw previews with"
        if self.card.latent_rgb is not None and len(self.card.latent_rgb.factors) != self.components.facts.latent_channels:
            return (f"card {self.card.card_id!r}'s latent-to-RGB map has {len(self.card.latent_rgb.factors)} channels; "
                    f"the loaded weights' latents have {self.components.facts.latent_channels}")  # fmt: skip
        if self.card.latent_rgb is None and self.components.vae is None:
            return f"card {self.card.card_id!r} has no VAE loaded to fit its latent-to-RGB map from"
        return None

    @property
    def map(self) -> LatentRgbMap:
        if self._map is None:
            spec = self.card.latent_rgb
            self._map = LatentRgbMap.of(spec) if spec is not None else self._fit()
        return self._map

    def _fit(self) -> LatentRgbMap:
        step, facts = self._decode_step(), self.components.facts
        device = self.components.device

        def decode(latents: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return step(latents.to(device))["video"]

        return fit_latent_rgb(decode, facts.latent_channels, facts.vae_spatial)

    def check(self, request: Request) -> None:
        """RequestRejected naming preview_every when this request cannot have the previews it asks for."""
        every = request.preview_every
        if every is None:
            return
        if every > request.num_inference_steps:
            raise RequestRejected("preview_every", f"{every} is more than num_inference_steps={request.num_inference_steps}: "
                                                   "previews come after every k-th step, so k must be 1..num_inference_steps")  # fmt: skip
        if request.rollout is not None:
            raise RequestRejected("preview_every", "a rollout's SDE step does not expose its denoised estimate: leave preview_every unset")
        why = self.available
        if why is not None:
            raise RequestRejected("preview_every", why)

    def after_step(self, state, sampler, before: torch.Tensor, new_carry: list, noise: torch.Tensor | None) -> None:
        """Set `state.preview` when the step just folded in (state.step_index, 1-based now) is a preview step."""
        step, total = state.step_index, state.num_steps
        if step != total and step % state.preview_every:
            return
        mid = state.latents.shape[2] // 2  # a video's middle latent frame; an image's only one
        if step == total:  # the final latents: what the decode (or output_type="latent") gets
            frame = state.latents[0, :, mid]
        else:
            pick = lambda t: None if t is None else t[0, :, mid]  # noqa: E731  views: nothing copied yet
            frame = sampler.denoised(pick(before), pick(state.latents), [pick(t) for t in new_carry],
                                     state.coeffs[step - 1], pick(noise))  # fmt: skip
        image = self.map.image(frame.detach().to("cpu", torch.float32))  # the one host copy: [C, h, w]
        state.preview = PreviewEvent(state.request_id, step, image, total)
