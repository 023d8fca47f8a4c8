"""Iterative GRPO through the real loop (real Ray, real vLLM, the demo model): the preset refreshes the reference,
replays old groups and fine-tunes its reward model, in float32 and bfloat16; a run stopped after a checkpoint and
resumed equals the uninterrupted one (replay buffer, reward-model weights and optimizer included); replay works
asynchronously too."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOLATILE = ("time/", "throughput/", "memory/")
# 8 prompts a step: replay_fraction 0.2 replays round(8 x 0.2 / 0.8) = 2 groups; the reward model trains every 2 steps
# and the reference refreshes every 3.
SMALL = ["data.prompts_per_step=8", "rollout.num_workers=1", "data.replay_fraction=0.2",
         "reward.sources.rm.train.every=2", "reference.refresh_every=3"]


def run(tmp_path, model_dir, name, steps, *overrides):
    config = load_config(CONFIGS / "iterative_grpo.yaml", [f"run_dir={tmp_path / name}", f"model.path={model_dir}",
                                                            f"max_steps={steps}", *SMALL, *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False, pool=POOL)


@pytest.fixture(scope="module")
def whole(ray_local, tmp_path_factory, demo_model_dir):
    """5 steps of the preset in float32, with a checkpoint at step 3: (records, run directory)."""
    base = tmp_path_factory.mktemp("iterative")
    return run(base, demo_model_dir, "whole", 5, "checkpoint.every=3"), base / "whole"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_preset_refreshes_replays_and_fine_tunes_its_reward_model(whole, ray_local, tmp_path, demo_model_dir,
                                                                      dtype):
    records = whole[0][:4] if dtype == "float32" else run(tmp_path, demo_model_dir, "preset", 4, f"model.dtype={dtype}")
    assert [r["replay/fraction"] for r in records] == [0.0, 0.2, 0.2, 0.2]  # 2 of 10 groups once the buffer has them
    assert [r["rollout/completions"] for r in records] == [64, 80, 80, 80]
    assert records[1]["replay/staleness"] == 1 and records[3]["replay/staleness"] > 1  # from steps 1..3
    assert [r["reference/version"] for r in records] == [0, 0, 2, 2]
    fits = [r for r in records if "reward_model/rm/loss" in r]
    assert [r["step"] for r in fits] == [2, 4]
    assert all(r["reward_model/rm/pairs"] > 0 for r in fits)
    assert all("rollout_correction/weight_mean" in r and r["train/skipped_updates"] == 0 for r in records)
    for record in records:  # the combined reward: correct + 0.5 x the reward model's whitened score
        assert record["reward/mean"] == pytest.approx(record["reward/correct"] + 0.5 * record["reward/rm"], abs=1e-6)


def test_a_resumed_run_equals_the_uninterrupted_one(whole, ray_local, tmp_path, demo_model_dir):
    """Stopped after the checkpoint at step 3 (the reward model fine-tuned at step 2, the buffer holding 3 steps'
    groups) and resumed: steps 4 and 5 and the final weights equal the uninterrupted run's."""
    records, whole_dir = whole
    run(tmp_path, demo_model_dir, "parts", 3, "checkpoint.every=3")
    saved = tmp_path / "parts" / "checkpoints" / "step_3"
    assert (saved / "replay.npz").is_file() and (saved / "reward_models" / "rm" / "config.json").is_file()
    resumed = run(tmp_path, demo_model_dir, "parts", 5, "checkpoint.every=3", "resume=auto")
    stable = [[{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in part]
              for part in (records[3:], resumed)]
    assert [r["step"] for r in resumed] == [4, 5] and stable[0] == stable[1]
    assert "reward_model/rm/loss" in resumed[0] and resumed[0]["replay/fraction"] > 0
    for part in ("policy", "reward_models/rm"):
        weights = [load_file(root / "checkpoints" / "step_5" / part / "model.safetensors")
                   for root in (whole_dir, tmp_path / "parts")]
        assert all((weights[0][key] == weights[1][key]).all() for key in weights[0]), part


def test_replay_in_asynchronous_training(ray_local, tmp_path, demo_model_dir):
    records = run(tmp_path, demo_model_dir, "async", 4, "rollout.max_staleness=1")
    assert [r["replay/fraction"] for r in records] == [0.0, 0.2, 0.2, 0.2]
    assert all(r["async/staleness"] <= 1 for r in records)
