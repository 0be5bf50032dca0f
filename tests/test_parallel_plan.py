"""perf/parallel_plan.py: the paper plan's arithmetic, checked by hand on two rows."""

from fvgraph.perf.parallel_plan import plan_row, tokens


def test_sequence_lengths_after_the_vae_and_patching():
    assert tokens(81, 480, 832, (1, 2, 2)) == 21 * 30 * 52 == 32760
    assert tokens(81, 720, 1280, (1, 2, 2)) == 21 * 45 * 80 == 75600


def test_ulysses_bytes_and_the_degrees_the_heads_allow():
    row = plan_row("wan2.1-14b", "480p", 1, 8, [1.0], 0.0)
    one = 2 * 4095 * 5120 * 2 * 7 / 8  # both CFG rows, S/8 tokens, hidden 5120, bf16; 7/8 of it leaves the rank
    assert row["all_to_all_bytes"] == round(one) and row["all_to_alls_per_step"] == 4 * 40
    assert row["gather_bytes"] == 2 * 4095 * 64 * 2 * 7
    assert row["step_bytes_per_gpu"] == round(one * 160 + row["gather_bytes"])
    assert row["comm_s@1"] == round(row["step_bytes_per_gpu"] / 450e9, 4)
    assert 1 < row["speedup@1"] < 8
    bad = plan_row("wan2.1-1.3b", "480p", 1, 8, [1.0], 0.0)
    assert bad["valid"] is False and bad["why"] == "Ulysses 8 does not divide 12 heads"
    cfg = plan_row("wan2.1-1.3b", "720p", 2, 1, [1.0], 0.0)
    assert cfg["all_to_alls_per_step"] == 0 and cfg["cfg_exchange_bytes"] == 75600 * 64 * 2 and cfg["speedup@1"] == 2.0
