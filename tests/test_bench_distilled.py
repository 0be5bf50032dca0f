"""perf/bench_distilled.py at a tiny size prints one JSON line with both cases and what each request ran
(no timing is asserted: only the line's shape and the transformer calls counted)."""

import json

from fvgraph.perf import bench_distilled

SPREAD = {"repeats", "min", "median", "max"}


def test_the_bench_prints_both_cases_with_their_transformer_calls(capsys):
    base_steps = 3
    bench_distilled.main(["--card", "tiny-wan", "--shape", "48x64x5", "--base-steps", str(base_steps), "--repeats", "1"])
    [line] = [json.loads(text) for text in capsys.readouterr().out.splitlines() if text.startswith("{")]
    assert line["bench"] == "distilled" and line["method_version"] >= 1 and "commit" in line and "machine" in line
    assert line["card"] == "tiny-wan" and line["distilled_card"] == "tiny-wan-4step" and line["opt_level"] == 0
    cases = {bench_distilled.BASE, bench_distilled.DISTILLED}
    assert set(line["s_per_request"]) == cases and all(set(s) == SPREAD for s in line["s_per_request"].values())
    assert set(line["time_ratio_per_round"]["base_vs_distilled"]) == SPREAD
    assert line["steps"] == {"base_50step_cfg": base_steps, "distilled_4step": 4}
    assert line["transformer_calls_per_request"] == {"base_50step_cfg": base_steps * 2, "distilled_4step": 4}
    # every step the engine counted was a denoise step (no text encoder, latents out); -O0 compiles nothing
    ran = line["ran_per_request"]
    assert ran["base_50step_cfg"] == {"denoise_steps": base_steps, "transformer_calls": base_steps * 2,
                                      "engine_steps": base_steps, "compiles": 0}  # fmt: skip
    assert ran["distilled_4step"] == {"denoise_steps": 4, "transformer_calls": 4, "engine_steps": 4, "compiles": 0}
    assert line["warmup_compiles"] == {"base_50step_cfg": 0, "distilled_4step": 0}
