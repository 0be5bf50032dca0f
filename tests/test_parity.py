"""The parity diff names the first block and step where two settings diverge, and nothing before it."""

import json

import pytest
import torch
from typer.testing import CliRunner

from fvgraph.cli import app
from fvgraph.parity import Setting, compare
from fvgraph.request import Request

REQUESTS = [
    Request(prompt="a red fox", seed=1, num_inference_steps=4, num_frames=5),
    Request(prompt="waves", seed=2, guidance_scale=3.0, num_inference_steps=3, num_frames=5),
]


def _perturb_block_at_step(block: int, step: int):
    """A hook on one block that adds an error on its cond call at one denoise step (of request 0)."""

    def prepare(engine):
        calls = {"n": 0}

        def hook(module, args, output):
            calls["n"] += 1
            return output + 1e-2 if calls["n"] == 2 * step + 1 else output  # 2 calls (cond, uncond) a step

        # before the tap hook, so the tap sees the perturbed output
        engine.loop.components.transformer.blocks[block].register_forward_hook(hook, prepend=True)

    return prepare


def test_injected_error_is_the_first_divergence():
    report = compare("tiny-wan", REQUESTS, Setting(0), Setting(0), device="cpu", prepare_b=_perturb_block_at_step(1, 2))
    first = report.first_divergence
    assert not report.passed
    assert (first.request, first.step, first.tap) == (0, 2, "tap.block.1.0")
    before = report.comparisons[: report.comparisons.index(first)]
    assert before and all(c.passed and c.max_abs == 0 for c in before)
    assert first.max_abs > 1e-3 and first.atol_to_pass == first.max_abs


@pytest.fixture(scope="module")
def o0_vs_o1():
    return compare("tiny-wan", REQUESTS, Setting(0), Setting(1, backend="aot_eager"), device="cpu")


def test_clean_o0_vs_o1_passes_with_the_declared_tolerances(tmp_path, o0_vs_o1):
    report = o0_vs_o1
    assert report.passed, report.first_divergence
    taps = {c.tap for c in report.comparisons}
    assert {"tap.block.0.0", "tap.block.1.1", "tap.noise.cond", "tap.noise.uncond", "tap.noise", "tap.latents"} <= taps
    path = report.write_jsonl(tmp_path / "parity.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "config" and lines[-1]["type"] == "summary" and lines[-1]["passed"]
    assert all(line["type"] == "comparison" for line in lines[1:-1])
    per_step = 2 * 2 + 3 + 1  # 2 blocks x 2 branches, 3 predictions, the new latents
    assert len(lines) - 2 == len(report.comparisons) == per_step * (4 + 3)


def test_eager_side_floor_is_eager_at_another_batch_composition(o0_vs_o1):
    """The floor of an eager-vs-compiled report comes from eager runs of both requests as one padded
    batch, not from a rerun of side a one at a time (which would give a floor of exactly 0)."""
    report = o0_vs_o1
    assert report.config["noise_floor"].endswith("(O0 batched)")
    sizes = report.config["denoise_batch_sizes"]
    assert sizes["a"] == [1] and sizes["floor"] == [1, 2]  # both requests together while both run
    floors = [c.floor_max_abs for c in report.comparisons]
    assert all(f is not None and f >= 0 for f in floors)
    # batch 2 rounds differently from batch 1 in fp32 GEMMs: the floor measures that, above zero
    assert max(floors) > 0 and sum(f > 0 for f in floors) > len(floors) // 2
    assert max(floors) < report.config["atol"]  # the padded batch computes the same thing: rounding only


def test_cli_exits_nonzero_on_failure_and_zero_on_success(tmp_path, tiny_checkpoint):
    runner = CliRunner()
    ok = runner.invoke(app, ["parity", "--card", "tiny-wan", "--checkpoint", str(tiny_checkpoint), "-O0",
                             "--against", "0", "--steps", "2", "--report", str(tmp_path / "p.jsonl")])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "passed" in ok.output and (tmp_path / "p.jsonl").is_file()
    bad = runner.invoke(app, ["parity", "--card", "tiny-wan", "-O0", "--against", "7", "--steps", "2"])
    assert bad.exit_code == 2 and "opt_level=7" in bad.output


def test_batch_one_vs_batched_is_within_tolerance_and_has_no_floor():
    """O1 one request at a time vs all requests in one batch: the batch-composition comparison."""
    a, b = Setting(1, backend="aot_eager"), Setting(1, backend="aot_eager", batched=True)
    report = compare("tiny-wan", REQUESTS, a, b, device="cpu")
    assert report.passed, report.first_divergence
    assert report.config["b"] == "O1 aot_eager batched"
    # a floor run would be side a in b's composition, which is side b: the report says there is none
    assert report.config["noise_floor"].startswith("none:") and "floor" not in report.config["denoise_batch_sizes"]
    assert all(c.floor_max_abs is None for c in report.comparisons)
    assert report.config["denoise_batch_sizes"] == {"a": [1], "b": [1, 2]}


def test_o3_fp8_vs_o0_is_within_the_declared_fp8_tolerance():
    """-O3 (FP8 weights, quantize pass) against eager, tap by tap, held to the card's fp8 tolerance."""
    report = compare("tiny-wan", REQUESTS, Setting(0), Setting(3, backend="aot_eager"), device="cpu")
    summary = report.summary()
    assert report.config["precision"] == "fp8" and summary["passed"], summary
    # FP8 really ran: the diff is far above fp32 noise, yet the final latents stay close in direction.
    final = [c for c in report.comparisons if c.tap == "tap.latents" and c.step == 3 and c.request == 0][0]
    assert 1e-3 < final.max_abs and final.rel_diff < 0.05, (final.max_abs, final.rel_diff, final.max_rel)
