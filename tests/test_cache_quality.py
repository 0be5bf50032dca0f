"""Quality as a parity rung: a cached run's distance from the uncached one, per step and in frames."""

import json

from typer.testing import CliRunner

from fvgraph.step_caching_quality import cache_distance
from fvgraph.cli import app
from fvgraph.caching.methods import parse_cache_settings
from fvgraph.parity import Setting, compare
from fvgraph.request import Request

STEPS = 6
TEXT = f"magcache:threshold=0.06,max_skip_steps=2,mag_ratios={[1.0] + [0.99] * (STEPS - 1)}".replace(" ", "")
REQUESTS = [Request(prompt="a red fox", seed=1, num_inference_steps=STEPS, num_frames=1, height=32, width=32),
            Request(prompt="waves", seed=2, guidance_scale=1.0, num_inference_steps=STEPS, num_frames=1, height=32, width=32)]  # fmt: skip


def test_the_distance_is_zero_until_the_first_reuse_and_reported_after(tiny_engine, tmp_path):
    report = cache_distance(tiny_engine, REQUESTS, TEXT)
    assert report.config["against"] == "none" and report.config["cache"]["method"] == "magcache"
    for r in report.requests:
        assert len(r.rel_l2) == STEPS
        assert r.rel_l2[0] == 0.0  # step 0 computes: the keep step equals the plain step bit for bit
        assert r.rel_l2[1] > 0 and r.final_rel_l2 == r.rel_l2[-1] > 0  # step 1 reuses the blocks' residual
        assert r.psnr is not None and 0 < r.psnr < 200
        assert 0 < r.flops_ratio < 1 and r.reused > 0
    assert (report.requests[0].computed, report.requests[1].computed) == (4, 2)  # CFG: two calls a step
    lines = [json.loads(line) for line in report.write_jsonl(tmp_path / "q.jsonl").read_text().splitlines()]
    assert [line["type"] for line in lines] == ["config", "request", "request", "summary"]
    assert lines[-1]["min_psnr"] == min(r.psnr for r in report.requests)

    never = cache_distance(tiny_engine, REQUESTS[:1], f"{TEXT},max_skip_steps=0")  # computes every step
    [r] = never.requests
    assert r.rel_l2 == [0.0] * STEPS and r.psnr is None and r.flops_ratio == 1.0


def test_parity_with_cache_compares_the_cached_steps_latents():
    requests = [r.model_copy(update={"cache": parse_cache_settings(TEXT), "num_inference_steps": 3}) for r in REQUESTS]
    report = compare("tiny-wan", requests, Setting(0), Setting(0, batched=True), device="cpu")
    assert {c.tap for c in report.comparisons} == {"tap.latents"}  # the keep and reuse kinds have no tap variant
    assert len(report.comparisons) == 2 * 3 and report.passed


def test_parity_cli_against_none_reports_and_needs_cache(tmp_path):
    runner = CliRunner()
    out = tmp_path / "quality.jsonl"
    base = ["parity", "-O0", "--steps", str(STEPS), "--frames", "1", "-p", "a fox"]
    result = runner.invoke(app, [*base, "--cache", TEXT, "--against", "none", "--report", str(out)])
    assert result.exit_code == 0, result.output
    assert "reported, not asserted" in result.output
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["type"] == "summary" and summary["requests"] == 1 and summary["flops_ratio"] < 1
    missing = runner.invoke(app, [*base, "--against", "none"])
    assert missing.exit_code == 2 and "give --cache" in missing.output
    bad = runner.invoke(app, [*base, "--against", "zero"])
    assert bad.exit_code == 2 and "--against='zero' must be an opt level" in bad.output
