"""The interleave gate: requests run interleaved step by step equal the same requests run one at a time."""

import torch

from fvgraph.request import Request
from conftest import embeds


def _requests(card):
    pos, neg = embeds(5, card)
    return [
        Request(prompt="a lighthouse at dusk", seed=1, num_inference_steps=5, num_frames=5),
        Request(prompt="waves", negative_prompt="fog", seed=2, guidance_scale=7.5, num_inference_steps=3),
        Request(prompt_embeds=pos, negative_prompt_embeds=neg, seed=3, num_inference_steps=4, height=48, width=80),
        Request(prompt="no guidance", seed=4, guidance_scale=1.0, num_inference_steps=2, output_type="latent"),
    ]


def test_interleaved_equals_serial_bit_for_bit(tiny_engine, tiny_card):
    serial = [tiny_engine.generate([r])[0] for r in _requests(tiny_card)]
    interleaved = tiny_engine.generate(_requests(tiny_card))
    for alone, together in zip(serial, interleaved):
        assert alone.ok and together.ok
        assert torch.equal(alone.latents, together.latents)
        if alone.frames is not None:
            assert (alone.frames == together.frames).all()


def test_steps_really_interleave(tiny_engine, tiny_card):
    """The engine advances every running request once per tick instead of finishing one first."""
    order = []
    tiny_engine.generate(_requests(tiny_card)[:2], on_step=lambda state, kind: order.append(state.request_id))
    first_two = order[:2]
    assert first_two[0] != first_two[1]
