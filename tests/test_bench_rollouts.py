"""perf/bench_rollouts.py at a tiny size prints one JSON line with both cases and the transformer
calls each sample ran (no timing is asserted: only the line's shape and the calls counted)."""

import json

from fvgraph.perf import bench_rollouts

SPREAD = {"repeats", "min", "median", "max"}


def test_the_bench_prints_both_cases_with_their_transformer_calls(capsys):
    steps = 2
    bench_rollouts.main(["--card", "tiny-wan", "--shape", "48x64x5", "--steps", str(steps), "--repeats", "1"])
    [line] = [json.loads(text) for text in capsys.readouterr().out.splitlines() if text.startswith("{")]
    assert line["bench"] == "rollouts" and line["method_version"] >= 1 and "commit" in line and "machine" in line
    assert line["card"] == "tiny-wan" and line["opt_level"] == 0 and line["group_size"] == 8 and line["steps"] == steps
    cases = {bench_rollouts.ENGINE, bench_rollouts.PRIVATE}
    for field in ("samples_per_s", "s_per_group"):
        assert set(line[field]) == cases and all(set(s) == SPREAD for s in line[field].values())
    assert set(line["samples_per_s_ratio_per_round"]["engine_vs_private"]) == SPREAD
    # CFG: two branch evaluations per denoise step on both sides
    assert line["transformer_calls_per_sample"] == {bench_rollouts.ENGINE: 2 * steps, bench_rollouts.PRIVATE: 2 * steps}
    # -O0: the text encode, then each sample's steps on their own; nothing batched or compiled
    assert line["engine_per_group"] == {"engine_steps": 1 + 8 * steps, "batches": 0, "compiles": 0}
    assert line["warmup_compiles"] == 0
