"""perf/stand_in_step.py and bench_scheduler_overhead.py --stand-in: the step stood in for by its recorded
outputs, so the host's cost is timed with and without the step's effect on the caches."""

import json
from types import SimpleNamespace

import torch

from fvgraph.perf import bench_scheduler_overhead as bench
from fvgraph.perf.stand_in_step import StandInPrologue, StandInStep


def test_the_stand_in_returns_the_first_runs_outputs_without_running_the_step():
    passed_through = torch.zeros(2, 3)
    entry = SimpleNamespace(input_at={passed_through.data_ptr(): ("carry", passed_through)})
    calls = []

    def replay(e):
        calls.append(e)
        return (torch.full((2, 3), float(len(calls))), passed_through)

    step = StandInStep(replay)
    first = step(entry)
    assert step(entry)[0][0, 0] == 2.0 and len(calls) == 2  # "step": the real replay every time
    for mode in ("warm", "evict"):
        step.mode = mode
        computed, carried = step(entry)
        assert len(calls) == 2, mode  # no replay
        assert torch.equal(computed, first[0]) and computed.data_ptr() != first[0].data_ptr()  # a fresh copy
        assert carried is passed_through  # an input buffer comes back as the buffer, as from the step


def test_one_run_times_the_mix_with_the_step_warm_and_evicted(capsys):
    bench.main(["--card", "tiny-wan", "--requests", "2", "--steps", "2", "--repeats", "3", "--backend", "eager",
                "--batch-sizes", "1", "--stand-in"])  # fmt: skip
    [line] = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    assert line["bench"] == "scheduler_overhead_stand_in"
    for mode in ("step", "warm", "evict", "host"):  # the same mix each way: 2 requests of 2 and 1 steps
        assert (line[mode]["request_steps"], line[mode]["batches"]) == (3, 3), mode
        assert line[mode]["prologue_runs"] == 2, mode  # stood in for or not, each request's prologue runs
        assert line[mode]["hoisted_rows_copied"] == 2, mode  # copied or, in "host", counted
        assert line[mode]["overhead_us_per_batch"]["repeats"] == 3
    assert line["warm_over_step"]["repeats"] == 3 and line["evict_over_step"]["min"] > 0 and line["host_over_step"]["min"] > 0


def test_named_modes_are_timed_alone(capsys):
    bench.main(["--card", "tiny-wan", "--requests", "2", "--steps", "2", "--repeats", "2", "--backend", "eager",
                "--batch-sizes", "1", "--stand-in", "host"])  # fmt: skip
    [line] = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    assert [mode for mode in ("step", "warm", "evict", "host") if mode in line] == ["host"]
    assert line["host"]["overhead_us_per_batch"]["repeats"] == 2 and line["host"]["hoisted_rows_copied"] == 2
    assert not any(key.endswith("_over_step") for key in line)  # no ratio without the real step beside it


def test_in_host_mode_a_prologue_returns_its_first_outputs_without_running():
    step, calls = StandInStep(lambda entry: ()), []
    prologue = StandInPrologue(lambda *args: calls.append(args) or (torch.full((2,), float(len(calls))),), step)
    first = prologue(1)
    for mode in ("step", "warm", "evict"):  # the prologue runs
        step.mode = mode
        assert prologue(2)[0][0] == float(len(calls)) and calls[-1] == (2,), mode
    step.mode = "host"
    assert prologue(3) is first and len(calls) == 4  # its first outputs, as they are; no run
