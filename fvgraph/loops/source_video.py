"""Video-to-video on Wan's text-to-video loop: a request that brings a `video` starts from it.

As diffusers' WanVideoToVideoPipeline: the video is resized to the request's size, encoded by the VAE
(the posterior's mode, normalised by the VAE's latent mean and std), and noised to the first step the
request runs; the schedule is the card's, entered at step N - int(N * strength) (samplers.start_step),
so only the last steps run. Both Wan samplers noise as the flow rule x = (1 - sigma) * x0 + sigma * noise
(UniPC's `add_noise` with flow sigmas, FlowMatchEuler's `scale_noise`), and the noise is the request's
one draw of the latents' shape, as the pipeline's. Then it is the text-to-video loop: same denoise
steps, so video-to-video and text-to-video requests batch into one graph.

Phases of a video request: text_encode -> vae_encode (its own kind here, tiled with `vae_tiling`)
-> denoise x int(N * strength) -> vae_decode. A request without a video never enters vae_encode.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.video_processor import VideoProcessor
from torch import nn

from fvgraph.card import ModelCard
from fvgraph.contract.phase import Phase
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.loops.denoise_state import DenoiseState
from fvgraph.loops.i2v_steps import FirstFrameEncodeStep
from fvgraph.loops.tiled_coding import VAE_ENCODE, VAE_ENCODE_KIND
from fvgraph.models.components import Components
from fvgraph.request import Request, RequestRejected


class VideoEncodeStep(FirstFrameEncodeStep):
    """A video [B, 3, F, H, W] in [-1, 1] -> its normalized VAE latents [B, C, f, h, w] (the posterior's mode)."""

    def video(self, image: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return image.to(self.latents_mean.dtype)


class SourceVideo:
    """The optional video of a text-to-video request: encoded, then noised into its first latents."""

    phases = (Phase.VAE_ENCODE,)
    step_kinds = {VAE_ENCODE: VAE_ENCODE_KIND}
    reads = ("video", "strength")
    device_fields = ("source_video",)

    def __init__(self, card: ModelCard, components: Components):
        self.card, self.components = card, components
        self.video_processor = VideoProcessor(vae_scale_factor=components.facts.vae_spatial)

    def build(self, components: Components) -> dict[str, nn.Module]:
        return {VAE_ENCODE: VideoEncodeStep(components.vae)}

    def check(self, resolved: Request) -> None:
        if resolved.video is None:
            return
        if self.card.recipe.sampler.timestep_list is not None:
            raise RequestRejected("video", f"recipe {self.card.recipe.name!r} runs its listed timesteps from the first; "
                                           "video-to-video enters the card's schedule part-way")  # fmt: skip
        for name in ("rollout", "cache"):
            if getattr(resolved, name) is not None and not _is_off(getattr(resolved, name)):
                raise RequestRejected(name, f"a video-to-video request runs without {name}: leave it unset")

    def init_fields(self, request: Request, latents: torch.Tensor) -> dict[str, Any]:
        """The video as the pipeline preprocesses it (host, once per request)."""
        if request.video is None:
            return {}
        video = self.video_processor.preprocess_video(request.video, height=request.height, width=request.width)
        return {"source_video": video.to(self.components.device, torch.float32)}

    def first_phase(self, state: DenoiseState) -> Phase | None:
        return Phase.VAE_ENCODE if state.source_video is not None else None

    def plan(self, state: DenoiseState) -> WorkPlan:
        return WorkPlan(state.request_id, VAE_ENCODE, {"image": state.source_video, "latents": state.latents})

    def take(self, state: DenoiseState, result: StepResult) -> None:
        """The encoded video noised to the first step's sigma; `state.latents` held the request's noise."""
        sigma = state.coeffs[0, 0].to(state.latents.device)  # both Wan samplers' first column: the step's sigma
        state.latents = (1 - sigma) * result["condition"] + sigma * state.latents
        state.source_video = None
        state.phase = Phase.DENOISE

    def constants(self, state: DenoiseState) -> dict[str, torch.Tensor]:
        return {}

    def after_last_step(self, state: DenoiseState) -> None:
        pass

    def check_saved(self, state: DenoiseState) -> None:
        video = state.source_video
        if video is None:
            return
        if not isinstance(video, torch.Tensor) or video.dim() != 5 or video.shape[:2] != (1, 3) or not video.is_floating_point():
            raise ValueError(f"state of request {state.request_id!r}: source_video: must be a float tensor [1, 3, F, H, W]")
        if not torch.isfinite(video).all():
            raise ValueError(f"state of request {state.request_id!r}: source_video: must be finite")

    def warmup_inputs(self, height: int, width: int) -> dict[str, Any]:
        return {}  # a text-to-video request runs the same denoise steps; `fvgraph warmup` encodes no video


def _is_off(value: Any) -> bool:
    """Step caching left at "none" (NoCache) is no caching."""
    return getattr(value, "method", None) == "none"
