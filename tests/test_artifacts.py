"""Typed artifacts with provenance (Result.artifacts) and typed events that cannot be built invalid."""

import numpy as np
import pytest
import torch

from fvgraph.artifacts import ImageArtifact, LatentArtifact, Provenance, VideoArtifact
from fvgraph.events import MediaChunk, MediaComplete, MediaInit, MediaStream, PreviewEvent, RequestEvent, StepEvent
from fvgraph.request import Request


def test_a_video_result_lists_its_latents_and_video_with_provenance(tiny_engine, tiny_card):
    (result,) = tiny_engine.generate([Request(prompt="a fox", seed=7, num_inference_steps=3, num_frames=5)])
    latent, video = result.artifacts
    assert isinstance(latent, LatentArtifact) and isinstance(video, VideoArtifact)
    assert latent.latents is result.latents and video.frames is result.frames  # the same arrays, no copy
    assert video.fps == tiny_card.fps == 16
    made = latent.provenance
    assert (made.card_id, made.seed, made.opt_level, made.parallel, made.precision) == ("tiny-wan", 7, 0, "single", "fp32")
    assert (made.produced_by, made.step) == ("denoise", 3)
    assert made.weights_version == tiny_engine.loop.components.weights_version
    assert made.recipe["flow_shift"] == tiny_card.recipe.sampler.config["flow_shift"]
    assert (video.provenance.produced_by, video.provenance.step) == ("vae_decode", None)
    assert dict(made.adapters) == {}


def test_latent_output_gives_only_the_latent_artifact(tiny_engine):
    (result,) = tiny_engine.generate([Request(prompt="x", num_inference_steps=2, output_type="latent")])
    assert [type(a) for a in result.artifacts] == [LatentArtifact] and result.frames is None


def test_a_rejected_request_has_no_artifacts(tiny_engine):
    (result,) = tiny_engine.generate([Request(prompt="x", num_inference_steps=2, preview_every=3)])
    assert result.status == "rejected" and result.artifacts == []


def _provenance(**changes):
    fields = dict(card_id="c", weights_version="w", precision="fp32", opt_level=1, parallel="single", seed=0, produced_by="vae_decode")
    return Provenance(**{**fields, **changes})


def test_artifacts_check_themselves():
    frames = np.zeros((2, 8, 8, 3), np.uint8)
    VideoArtifact(frames, 16, _provenance())
    ImageArtifact(frames[:1], _provenance())
    with pytest.raises(ValueError, match="uint8"):
        VideoArtifact(frames.astype(np.float32), 16, _provenance())
    with pytest.raises(ValueError, match="fps"):
        VideoArtifact(frames, 0, _provenance())
    with pytest.raises(ValueError, match="latents"):
        LatentArtifact(torch.zeros(1, 16, 2, 2), _provenance())  # 4-D: not [1, C, F, h, w]
    with pytest.raises(ValueError, match="opt_level"):
        _provenance(opt_level=7)
    with pytest.raises(ValueError, match="step"):
        _provenance(step=0)
    recipe = _provenance(recipe={"flow_shift": 3.0}).recipe
    with pytest.raises(TypeError):
        recipe["flow_shift"] = 5.0  # frozen: provenance cannot be edited after the fact


def test_media_events_know_their_stream_and_fidelity():
    video, preview = MediaStream("video", "video/mp4"), MediaStream("preview", "image/png", fidelity="preview")
    chunk = MediaChunk("r", video, 0, 0.0, 0.5, b"\x00moof")
    assert chunk.event_type == "media.chunk" and chunk.fidelity == "final"
    MediaInit("r", preview)
    MediaChunk("r", preview, 0, 0.0, 0.0, b"png", fidelity="preview")
    MediaComplete("r", video, chunks=3)
    with pytest.raises(ValueError, match="stream must be a MediaStream"):
        MediaChunk("r", None, 0, 0.0, 0.5, b"x")  # a chunk with no stream
    with pytest.raises(ValueError, match="name"):
        MediaStream("", "video/mp4")
    with pytest.raises(ValueError, match="time range"):
        MediaChunk("r", video, 0, 1.0, 0.5, b"x")
    with pytest.raises(ValueError, match="non-empty bytes"):
        MediaChunk("r", video, 0, 0.0, 0.5, b"")
    with pytest.raises(ValueError, match="cannot be marked final"):
        MediaChunk("r", preview, 0, 0.0, 0.0, b"png", fidelity="final")  # a preview marked final
    with pytest.raises(ValueError, match="cannot be marked final"):
        MediaComplete("r", preview, chunks=2)
    with pytest.raises(ValueError, match="fidelity"):
        MediaStream("video", "video/mp4", fidelity="draft")


def test_request_and_step_events_check_themselves():
    assert RequestEvent("r", "failed", error="boom").event_type == "request"
    assert StepEvent("r", 3, 3).event_type == "step.done"
    assert PreviewEvent("r", 1, np.zeros((2, 2, 3), np.uint8), 4).event_type == "step.preview"
    with pytest.raises(ValueError, match="error goes with status 'failed'"):
        RequestEvent("r", "done", error="boom")
    with pytest.raises(ValueError, match="status"):
        RequestEvent("r", "exploded")
    with pytest.raises(ValueError, match="step"):
        StepEvent("r", 4, 3)
    with pytest.raises(ValueError, match="request_id"):
        StepEvent("", 1, 3)
