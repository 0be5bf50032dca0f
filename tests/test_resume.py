"""A half-finished request saved to disk resumes in a new Engine to the same result, bit for bit."""

import pytest
import torch

from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.loops.t2v_loop import T2VState


@pytest.mark.parametrize("steps_before_save", [0, 1, 2, 4])
def test_save_mid_run_and_resume_in_new_engine(tmp_path, tiny_engine, steps_before_save):
    """Saved before the text encode, after it, or between denoise steps."""
    request = Request(prompt="a paper boat", seed=9, num_inference_steps=4, num_frames=5)
    uninterrupted = tiny_engine.generate([request])[0]

    state = tiny_engine.start(request)
    for _ in range(steps_before_save):
        tiny_engine.step(state)
    state.save(tmp_path / "state.pt")

    fresh = Engine.from_card("tiny-wan", device="cpu")
    resumed = fresh.finish(fresh.resume(T2VState.load(tmp_path / "state.pt")))
    assert torch.equal(resumed.latents, uninterrupted.latents)
    assert (resumed.frames == uninterrupted.frames).all()


def test_state_of_another_card_is_refused(tmp_path, tiny_engine):
    state = tiny_engine.start(Request(prompt="x", seed=0))
    state.card_id = "wan2.1-t2v-1.3b"
    with pytest.raises(ValueError, match="belongs to card"):
        tiny_engine.resume(state)


def test_loading_a_non_state_file_is_refused(tmp_path):
    torch.save({"type": "Something", "fields": {}}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="expected a T2VState"):
        T2VState.load(tmp_path / "x.pt")


def test_a_state_holding_rows_of_a_batch_saves_only_its_own_rows(tmp_path, tiny_engine):
    """Compiled batches hand each request a view of its rows; a saved state must not carry the batch."""
    state = tiny_engine.start(Request(prompt="a fox", seed=3, num_frames=5))
    tiny_engine.step(state)  # text encode
    batch = torch.randn(64, *state.latents.shape[1:])
    batch[5:6] = state.latents
    state.latents = batch[5:6]  # what a batch of 64 leaves in a request's state
    state.save(tmp_path / "state.pt")
    own = T2VState.load(tmp_path / "state.pt")
    assert torch.equal(own.latents, state.latents)
    assert own.latents.untyped_storage().nbytes() == own.latents.nbytes
