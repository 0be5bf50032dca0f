"""examples/grpo_tiny.py, a Flow-GRPO trainer on the engine's rollouts, in a short run: the reward
rises, every weight sync reaches the next rollouts' records, and the first pass's recomputed
log-probs equal the recorded ones (the C2 rung). No timing is asserted."""

import importlib.util
import json
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny.py"
ITERATIONS = 12


def _example():
    spec = importlib.util.spec_from_file_location("grpo_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_short_grpo_run_raises_the_reward_and_syncs_every_step(tmp_path):
    result = _example().main(["--iterations", str(ITERATIONS), "--seed", "0", "--out", str(tmp_path)])
    rewards = result["mean_reward"]
    assert len(rewards) == ITERATIONS
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards
    # one optimizer step per iteration, a sync after each: iteration k's records carry step-k
    assert result["synced_versions"] == [f"step-{k}" for k in range(1, ITERATIONS + 1)]
    assert result["record_weights_version"][1:] == result["synced_versions"][:-1]
    assert max(result["first_epoch_logprob_gap"]) < 1e-4, result["first_epoch_logprob_gap"]
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    saved = json.loads((tmp_path / "reward_curve.json").read_text())
    assert saved["mean_reward"] == rewards
