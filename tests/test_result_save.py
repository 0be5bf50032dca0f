"""Result.save(path): the format by the extension, mp4 / gif for a video, png / webp / jpg too for one frame."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fvgraph.request import Result
from fvgraph.serving.media_encode import decode_mp4

RNG = np.random.default_rng(0)
VIDEO = RNG.integers(0, 256, size=(5, 32, 48, 3), dtype=np.uint8)
IMAGE = RNG.integers(0, 256, size=(1, 32, 48, 3), dtype=np.uint8)


def test_a_video_saves_as_mp4_and_gif(tmp_path):
    result = Result("r", "ok", frames=VIDEO)
    mp4 = result.save(tmp_path / "v.mp4", fps=16)
    decoded = decode_mp4(mp4.read_bytes())
    assert decoded.shape == VIDEO.shape  # every frame, at its size (lossy: the values differ)
    with Image.open(result.save(tmp_path / "v.gif")) as gif:
        assert gif.n_frames == 5 and gif.size == (48, 32)
    with pytest.raises(ValueError, match="an image file holds one frame"):
        result.save(tmp_path / "v.png")


@pytest.mark.parametrize(("suffix", "kind"), [(".png", "PNG"), (".webp", "WEBP"), (".jpg", "JPEG")])
def test_an_image_saves_by_its_extension(tmp_path, suffix, kind):
    path = Result("r", "ok", frames=IMAGE).save(tmp_path / f"i{suffix}")
    with Image.open(path) as image:
        assert image.format == kind and image.size == (48, 32)
    if kind == "PNG":
        assert np.array_equal(np.asarray(Image.open(path)), IMAGE[0])


def test_no_frames_or_an_unknown_extension_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ended 'failed' with no frames to save: boom"):
        Result("r", "failed", error="boom").save(tmp_path / "v.mp4")
    with pytest.raises(ValueError, match=r"must end in \.gif or \.mp4"):
        Result("r", "ok", frames=VIDEO).save(tmp_path / "v.avi")
