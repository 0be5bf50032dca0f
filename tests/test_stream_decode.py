"""Frames as they decode (fvgraph/loops/causal_decode.py): Wan's VAE decode runs one latent frame per
step, and each step's frames reach `on_frames` in order, final: their concatenation is the result's
frames, equal bit for bit to diffusers' own whole decode of the final latents, alone or interleaved
with another request. The fragmented MP4 built from them (fvgraph/serving/fmp4_stream.py) holds the
stored file's bitstream: the chunks out before the end decode to the file's first frames."""

import io

import av
import numpy as np
import pytest
import torch

from fvgraph import Engine, Request
from fvgraph.events import DecodedFrames
from fvgraph.serving.fmp4_stream import Fmp4Encoder
from fvgraph.serving.media_encode import decode_mp4, encode_mp4

SHAPE = {"height": 32, "width": 32, "num_frames": 17, "num_inference_steps": 2}  # 5 latent frames
WAN_TILES = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_sample_stride_height": 24, "tile_sample_stride_width": 24}


def _diffusers_decode(engine: Engine, latents: torch.Tensor) -> np.ndarray:
    """The final latents through diffusers' WanPipeline decode (denormalize, vae.decode, postprocess), as uint8."""
    vae = engine.loop.components.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents.to(vae.dtype) / std + mean, return_dict=False)[0]
    frames = (video / 2 + 0.5).clamp(0, 1)[0].permute(1, 2, 3, 0).float()
    return (frames * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def _run(engine: Engine, requests: list[Request]) -> tuple[list, dict[str, list[DecodedFrames]]]:
    seen: dict[str, list[DecodedFrames]] = {}
    results = engine.generate(requests, on_frames=lambda f: seen.setdefault(f.request_id, []).append(f))
    return results, seen


def test_frames_come_in_order_per_latent_frame_and_equal_diffusers_whole_decode(tiny_engine):
    [result], seen = _run(tiny_engine, [Request(prompt="a fox", seed=3, **SHAPE)])
    chunks = seen[result.request_id]
    assert [(c.start, len(c.frames)) for c in chunks] == [(0, 1), (1, 4), (5, 4), (9, 4), (13, 4)]
    assert [c.last for c in chunks] == [False] * 4 + [True] and {c.total for c in chunks} == {17}
    streamed = np.concatenate([c.frames for c in chunks])
    assert np.array_equal(streamed, result.frames)
    assert np.array_equal(result.frames, _diffusers_decode(tiny_engine, result.latents))


def test_interleaved_requests_stream_their_own_frames_unchanged(tiny_engine):
    a, b = Request(prompt="one", seed=1, **SHAPE), Request(prompt="two", seed=2, **{**SHAPE, "num_frames": 9})
    [alone_a], _ = _run(tiny_engine, [a.model_copy(update={"request_id": "alone-a"})])
    (ra, rb), seen = _run(tiny_engine, [a, b])
    for result in (ra, rb):
        chunks = seen[result.request_id]
        assert [c.start for c in chunks] == list(np.cumsum([0] + [len(c.frames) for c in chunks[:-1]]))
        assert np.array_equal(np.concatenate([c.frames for c in chunks]), result.frames)
    assert np.array_equal(ra.frames, alone_a.frames) and torch.equal(ra.latents, alone_a.latents)


def test_a_tiled_decode_hands_its_frames_on_at_its_end():
    engine = Engine.from_card("tiny-wan", device="cpu", vae_tiling=WAN_TILES)
    [result], seen = _run(engine, [Request(prompt="tiles", seed=0, height=64, width=64, num_frames=9, num_inference_steps=2)])
    [chunk] = seen[result.request_id]
    assert chunk.start == 0 and chunk.last and np.array_equal(chunk.frames, result.frames)


def test_the_fragments_out_before_the_end_decode_to_the_stored_files_first_frames(tiny_engine):
    [result], seen = _run(tiny_engine, [Request(prompt="streamed", seed=5, **SHAPE)])
    encoder, before_end = Fmp4Encoder(result.request_id, 8), []
    for chunk in seen[result.request_id]:
        before_end += encoder.add(chunk)
    after = encoder.finish()
    init, fragments = before_end[0], before_end[1:]
    assert init.event_type == "media.init" and fragments and all(e.event_type == "media.chunk" for e in fragments)
    stored = decode_mp4(encode_mp4(result.frames, 8))  # the server's faststart file
    early = decode_mp4(init.data + b"".join(e.data for e in fragments))
    assert 0 < len(early) < len(stored) and np.array_equal(early, stored[: len(early)])
    assert [e.index for e in fragments + after[:-1]] == list(range(after[-1].chunks))
    assert fragments[0].start_s == 0 and all(x.end_s == y.start_s for x, y in zip(fragments, fragments[1:] + after[:-1]))
    streamed = init.data + b"".join(e.data for e in fragments + after[:-1])
    assert np.array_equal(decode_mp4(streamed), stored)
    with av.open(io.BytesIO(streamed)) as container:  # the first frame at 0, one frame every 1/fps: no gap to wait at
        assert [frame.time for frame in container.decode(video=0)] == [i / 8 for i in range(len(stored))]


@pytest.mark.parametrize("start, total, words", [(-1, 4, "start"), (2, 3, "total"), (0, 0, "total")])
def test_decoded_frames_that_run_past_the_video_cannot_be_built(start, total, words):
    with pytest.raises(ValueError, match=words):
        DecodedFrames("r", start, np.zeros((2, 4, 4, 3), np.uint8), total)


def test_frames_that_do_not_continue_the_stream_are_refused():
    encoder = Fmp4Encoder("r", 8)
    encoder.add(DecodedFrames("r", 0, np.zeros((1, 4, 4, 3), np.uint8), 5))
    with pytest.raises(ValueError, match="do not continue"):
        encoder.add(DecodedFrames("r", 2, np.zeros((1, 4, 4, 3), np.uint8), 5))
