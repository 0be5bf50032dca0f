"""Step previews (Request.preview_every, docs/previews.md): the final result is bit-identical with and
without previews, the compiled step compiles once either way, the last preview is the card's map of
the final latents, a seeded card's fitted map reproduces its VAE, and bad values are refused naming
the field."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.events import PreviewEvent
from fvgraph.latent_rgb import LatentRgbMap
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec


def _requests(preview_every):
    """Two interleaved requests of different step counts; only the first asks for previews."""
    return [Request(prompt="a lighthouse", seed=1, num_inference_steps=5, num_frames=5, preview_every=preview_every),
            Request(prompt="waves", seed=2, num_inference_steps=3, guidance_scale=1.0)]  # fmt: skip


def _run(engine, preview_every):
    previews = []
    results = engine.generate(_requests(preview_every), on_preview=previews.append)
    assert all(r.ok for r in results), [r.error for r in results]
    return results, previews


def _assert_same_results(plain, previewed):
    for a, b in zip(plain, previewed):
        assert torch.equal(a.latents, b.latents)
        assert np.array_equal(a.frames, b.frames)


def test_previews_leave_the_result_bit_identical_at_O0(tiny_engine):
    plain, none = _run(tiny_engine, None)
    previewed, previews = _run(tiny_engine, 1)
    assert none == []
    _assert_same_results(plain, previewed)
    assert [(p.request_id, p.step, p.total) for p in previews] == [(previewed[0].request_id, s, 5) for s in range(1, 6)]


def test_previews_after_every_kth_step_and_the_last(tiny_engine):
    _, previews = _run(tiny_engine, 2)
    assert [p.step for p in previews] == [2, 4, 5]
    assert [p.last for p in previews] == [False, False, True]
    assert all(p.image.dtype == np.uint8 and p.image.shape == (8, 8, 3) for p in previews)  # 64x64 / 8


def test_last_preview_is_the_map_of_the_final_latents(tiny_engine):
    results, previews = _run(tiny_engine, 5)
    (last,) = previews
    latents = results[0].latents  # [1, C, F, h, w]
    mid = latents.shape[2] // 2
    factors, bias = tiny_engine.loop.previews.map.factors, tiny_engine.loop.previews.map.bias
    # written out in torch, float64 as the map computes, not by the map's own method
    rgb = torch.einsum("chw,cr->hwr", latents[0, :, mid].double(), factors.double()) + bias.double()
    expected = ((rgb + 1) / 2 * 255).clamp(0, 255).round().to(torch.uint8).numpy()
    assert np.array_equal(last.image, expected)


def test_early_previews_follow_the_denoised_estimate(tiny_engine):
    """Step k's preview is drawn from x0 = x - sigma * v of that step (UniPC's newest history entry):
    a preview late in the run is closer to the final one than an early one."""
    _, previews = _run(tiny_engine, 1)
    final = previews[-1].image.astype(float)
    distance = [np.abs(p.image.astype(float) - final).mean() for p in previews[:-1]]
    assert distance[-1] < distance[0]


def test_fitted_map_reproduces_the_seeded_vae(tiny_engine):
    """tiny-wan publishes no factors: its map is fitted once from its own VAE. Reported error (RMS of the
    fit's residual over the RMS of the decode, on random latents): printed for the record."""
    fitted = tiny_engine.loop.previews.map
    again = tiny_engine.loop.previews._fit()  # deterministic: the same VAE and seed give the same map
    assert torch.equal(fitted.factors, again.factors) and torch.equal(fitted.bias, again.bias)
    print(f"tiny-wan fitted latent-to-RGB relative RMS error: {fitted.fit_error:.4f}")
    assert fitted.factors.shape == (16, 3) and fitted.fit_error < 1.0  # better than predicting zero


@pytest.mark.parametrize("value", [0, -1, 1001, 2.5, "two", True])
def test_bad_preview_every_names_the_field(value):
    with pytest.raises(ValidationError, match="preview_every"):
        Request(prompt="x", preview_every=value)


def test_preview_every_past_the_step_count_is_rejected(tiny_engine):
    (result,) = tiny_engine.generate([Request(prompt="x", num_inference_steps=3, preview_every=4)])
    assert result.status == "rejected" and "preview_every" in result.error


def test_a_released_card_states_its_map(tiny_engine):
    from fvgraph.cards import get_card

    for card_id, channels in (("wan2.1-t2v-1.3b", 16), ("wan2.2-ti2v-5b", 48), ("flux.1-dev", 16)):
        spec = get_card(card_id).latent_rgb
        assert spec is not None and len(spec.factors) == channels
        assert LatentRgbMap.of(spec).factors.shape == (channels, 3)
    assert get_card("qwen-image").latent_rgb is None


def test_preview_event_checks_itself():
    image = np.zeros((4, 4, 3), np.uint8)
    assert PreviewEvent("r", 3, image, 3).last
    with pytest.raises(ValueError, match="step"):
        PreviewEvent("r", 0, image, 3)
    with pytest.raises(ValueError, match="step"):
        PreviewEvent("r", 4, image, 3)  # past the last step
    with pytest.raises(ValueError, match="uint8"):
        PreviewEvent("r", 1, image.astype(np.float32), 3)


@pytest.mark.parametrize("opt_level", [1, 2])
def test_compiled_step_compiles_once_with_and_without_previews(opt_level):
    """-O1 and -O2 (aot_eager; on the CPU -O2's runner replays the compiled callable on its static
    buffers): the same compiled step serves requests with and without previews, and the results are
    bit-identical with previews and without."""
    engine = Engine.from_card("tiny-wan", opt_level=opt_level, device="cpu", compile_config=CompileConfig(backend="aot_eager"),
                              buckets=BucketSpec(batch_sizes=(1, 2)))  # fmt: skip
    plain, _ = _run(engine, None)
    assert engine.counters.compiles >= 1  # the plain run compiled the step the previewed run must reuse
    with engine.counters.expect(compiles=0):
        previewed, previews = _run(engine, 1)
    _assert_same_results(plain, previewed)
    assert [p.step for p in previews] == [1, 2, 3, 4, 5]
