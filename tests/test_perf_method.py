"""The benchmark method: cases interleaved with a rotating order, spreads, paired ratios, provenance."""

import pytest
import torch

from fvgraph.perf.method import METHOD_VERSION, Case, interleaved, paired_ratio, provenance, spread

CPU = torch.device("cpu")


def test_rounds_time_every_case_once_in_a_rotating_order_after_an_untimed_warmup():
    calls = []
    cases = [Case(name, run=lambda n=name: calls.append(n), before=lambda n=name: calls.append("before-" + n))
             for name in ("a", "b", "c")]  # fmt: skip
    samples, warm = interleaved(cases, repeats=3, warmup=2, device=CPU)
    timed = [c for c in calls[12:] if not c.startswith("before")]
    assert calls[:4] == ["before-a", "a", "before-a", "a"]  # warmup: each case in turn, `before` each call
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(calls[12 + 2 * i] == "before-" + timed[i] for i in range(9))
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3} and set(warm) == {"a", "b", "c"}


def test_spread_and_paired_ratio():
    assert spread([0.003, 0.001, 0.002], scale=1e3) == {"repeats": 3, "min": 1.0, "median": 2.0, "max": 3.0}
    # per round, not ratio of medians: round 1 is 4 / 2, round 2 is 3 / 1
    assert paired_ratio([4.0, 3.0], [2.0, 1.0]) == {"repeats": 2, "min": 2.0, "median": 2.5, "max": 3.0}
    with pytest.raises(ValueError, match="one sample per round"):
        paired_ratio([1.0], [1.0, 2.0])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="repeats=0"):
        interleaved([Case("a", lambda: None)], repeats=0, warmup=0, device=CPU)
    with pytest.raises(ValueError, match="distinct"):
        interleaved([Case("a", lambda: None), Case("a", lambda: None)], repeats=1, warmup=0, device=CPU)


def test_every_line_names_commit_method_and_machine():
    line = provenance("step", CPU)
    assert line["bench"] == "step" and line["method_version"] == METHOD_VERSION
    assert line["commit"] != "" and line["machine"]["cores"] >= 1 and line["machine"]["torch"] == torch.__version__


def test_one_arrival_trace_scaled_to_each_offered_load():
    from fvgraph.perf.bench_serving import arrivals_at, unit_gaps

    gaps = unit_gaps(10)
    slow, fast = arrivals_at(gaps, 0.5), arrivals_at(gaps, 2.0)
    assert abs(slow[-1] - 20.0) < 1e-9 and abs(fast[-1] - 5.0) < 1e-9  # n requests at L req/s span n / L seconds
    assert all(abs(a - 4 * b) < 1e-9 for a, b in zip(slow, fast))  # the same trace, scaled
    assert unit_gaps(10) == gaps and unit_gaps(10, seed=1) != gaps


def test_step_speedups_are_baseline_over_fvgraph_per_round_and_per_request_step_at_batch_b():
    from fvgraph.perf.bench_step import speedups_and_goals

    samples = {"fvgraph_O1": [1.0, 2.0], "diffusers_compile_repeated_blocks": [1.5, 3.0],
               "fvgraph_O1_b4": [2.0, 2.0], "diffusers_compile_repeated_blocks_b4": [4.0, 5.0]}  # fmt: skip
    speedups, goals = speedups_and_goals(samples, batch=4)
    assert goals["O1_vs_compile_repeated_blocks_b1"]["median"] == 1.5  # 1.5 / 1 and 3 / 2
    assert goals["O1_vs_compile_repeated_blocks_per_request_step_bB"] == {"repeats": 2, "min": 2.0, "median": 2.25, "max": 2.5}
    # diffusers one request at a time: 4 x its batch-1 step against one batch-4 fvgraph step
    assert goals["O1_bB_per_request_step_vs_compile_repeated_blocks_b1"]["min"] == 3.0
    assert speedups["O1_vs_diffusers_compile_repeated_blocks"] is goals["O1_vs_compile_repeated_blocks_b1"]


def test_serving_sweep_gives_every_system_the_same_trace_at_each_load_in_rotating_order():
    from fvgraph.perf.bench_serving import run_sweep
    from fvgraph.request import Request

    seen = []

    def server(name):
        def serve(requests, arrivals):
            seen.append((name, tuple(round(t, 9) for t in arrivals)))
            return {"p50_s": 1.0, "p95_s": 2.0, "completed_rps": len(requests) / arrivals[-1]}

        return serve

    requests = [Request(prompt="x", seed=i) for i in range(4)]
    rows = run_sweep({"a": server("a"), "b": server("b")}, requests, [1.0, 2.0], repeats=2)
    assert [name for name, _ in seen] == ["a", "b", "b", "a", "b", "a", "a", "b"]
    for load_index in (0, 1):  # per load: one trace, whoever serves it
        traces = {trace for i, (_, trace) in enumerate(seen) if (i // 2) % 2 == load_index}
        assert len(traces) == 1
    assert [row["offered_rps"] for row in rows] == [1.0, 2.0]
    assert rows[1]["a"]["completed_rps"] == {"repeats": 2, "min": 2.0, "median": 2.0, "max": 2.0}
