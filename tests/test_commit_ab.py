"""perf/bench_scheduler_overhead.py --against-commit: the commit before the loop-agnostic merge and this
tree, each in its own worker on its own fvgraph, timed interleaved in one run (a tiny setting here)."""

import json

import pytest

from fvgraph.perf import bench_scheduler_overhead as bench
from fvgraph.perf.commit_tree import resolve_commit

BEFORE_LOOP_AGNOSTIC_MERGE = "3939a97"  # first parent of de0168b, "Merge issue 14"


def _have(ref: str) -> bool:
    try:
        resolve_commit(ref)
    except ValueError:
        return False
    return True


needs_history = pytest.mark.skipif(not _have(BEFORE_LOOP_AGNOSTIC_MERGE), reason="a checkout without that history")


@needs_history
def test_one_run_times_both_trees_interleaved(capsys):
    bench.main(["--card", "tiny-wan", "--requests", "2", "--steps", "2", "--repeats", "2", "--backend", "eager",
                "--batch-sizes", "1", "--against-commit", BEFORE_LOOP_AGNOSTIC_MERGE])  # fmt: skip
    [line] = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    assert line["bench"] == "scheduler_overhead_ab" and line["base_commit"] == resolve_commit(BEFORE_LOOP_AGNOSTIC_MERGE)
    # each side ran its own fvgraph: the flat layout before fvgraph/ had subpackages, and this one
    assert (line["base"]["engine_module"], line["this"]["engine_module"]) == ("fvgraph.engine", "fvgraph.engine.engine")
    for side in ("base", "this"):  # the same mix on each side: 2 requests of 2 and 1 steps, one batch lane
        assert (line[side]["request_steps"], line[side]["batches"]) == (3, 3)
        assert line[side]["overhead_us_per_batch"]["repeats"] == 2
    assert line["overhead_ratio_this_over_base"]["repeats"] == 2 and line["overhead_ratio_this_over_base"]["min"] > 0


WITH_HOST_MODE = "17ee7b9"  # the graph runner's copies apart (_copy_hoisted, _copy_prologue_constants)


@pytest.mark.skipif(not _have(WITH_HOST_MODE), reason="a checkout without that history")
def test_with_the_stand_in_both_trees_are_timed_in_host_mode(capsys):
    bench.main(["--card", "tiny-wan", "--requests", "3", "--steps", "3", "--repeats", "2", "--backend", "eager",
                "--batch-sizes", "1", "2", "--against-commit", WITH_HOST_MODE, "--stand-in"])  # fmt: skip
    [line] = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    for side in ("base", "this"):  # each side stood its step in for after recording it, as its ready line says
        assert line[side]["mode"] == "host" and line[side]["engine_module"] == "fvgraph.engine.engine"
        assert line[side]["request_steps"] == 6 and line[side]["hoisted_rows_copied"] > 0
        assert line[side]["row_copies_us_per_batch"]["max"] < line[side]["overhead_us_per_batch"]["min"]
    assert line["overhead_ratio_this_over_base"]["repeats"] == 2


def test_an_ab_times_host_mode_alone():
    with pytest.raises(SystemExit, match="--stand-in warm: with --against-commit both trees run in host mode alone"):
        bench.main(["--against-commit", "HEAD", "--stand-in", "warm"])


def test_an_unknown_commit_is_refused_naming_it():
    with pytest.raises(ValueError, match="--against-commit='no-such-ref' is not a commit"):
        bench.main(["--against-commit", "no-such-ref"])
