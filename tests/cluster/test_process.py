"""Process supervision through the real loop (real Ray, real vLLM, the chained-sum demo model): the preset trains on
per-step rewards in float32 and bfloat16; the same step rewards from `relay verifier serve --step-verifier` over HTTP
give exactly the in-process run; a process reward model scores every step in its own actor."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS = 3


def run(tmp_path, model_dir, name, *overrides, config_file=CONFIGS / "grpo_process.yaml"):
    config = load_config(config_file, [
        f"run_dir={tmp_path / name}", f"model.path={model_dir}", f"max_steps={STEPS}", "data.prompts_per_step=8",
        "rollout.num_workers=1", *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False, pool=POOL)


@pytest.fixture(scope="module")
def rule_run(ray_local, tmp_path_factory, chain_model_dir):
    return run(tmp_path_factory.mktemp("process"), chain_model_dir, "rule")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_preset_trains_on_step_rewards(rule_run, ray_local, tmp_path, chain_model_dir, dtype):
    records = rule_run if dtype == "float32" else run(tmp_path, chain_model_dir, "bf16", "model.dtype=bfloat16")
    assert [r["weights/version"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        # Two partial sums per answer: the total reward is the number of right steps (the outcome source has weight
        # 0; an extra step earns 0), and a whole answer is right only if both steps are.
        assert 0 < record["reward/correct"] <= record["reward/mean"] / 2 < 1  # neither all right nor all wrong
        assert 0 < record["reward/steps"] < 1
        assert record["advantage/mean_abs"] > 0 and record["grad_norm"] > 0 and math.isfinite(record["loss/policy"])
        assert record["train/skipped_updates"] == 0 and "kl/mean" in record
        tolerance = 1e-4 if dtype == "float32" else 5e-2
        assert record["logprob/mismatch"] < tolerance and record["sync/probe_max_diff"] < tolerance


def test_remote_step_rewards_give_exactly_the_in_process_run_and_a_process_reward_model_scores_steps(
        rule_run, ray_local, tmp_path, chain_model_dir, tiny_prm_dir, serve_verifier):
    _, url = serve_verifier(["--step-verifier", "step_match"])
    preset = yaml.safe_load((CONFIGS / "grpo_process.yaml").read_text())
    preset["reward"]["sources"]["steps"] = {"type": "remote", "level": "steps", "urls": [url]}  # the same step_match
    preset["reward"]["sources"]["prm"] = {"type": "model", "level": "steps", "path": str(tiny_prm_dir), "weight": 0.0}
    config_file = tmp_path / "remote.yaml"
    config_file.write_text(yaml.safe_dump(preset))
    remote = run(tmp_path, chain_model_dir, "remote", config_file=config_file)
    # The PRM has weight 0: the same seed and the same step rewards make the whole run the same, step by step.
    for key in ("reward/mean", "reward/steps", "reward/correct", "loss/policy", "grad_norm", "advantage/mean_abs"):
        assert [r[key] for r in remote] == [r[key] for r in rule_run], key
    for record in remote:
        assert record["verifier/failures"] == 0 and record["verifier/steps/latency_mean_s"] > 0
        assert math.isfinite(record["reward/prm"]) and record["reward/prm"] != 0  # a random PRM: some score per step


def test_reinforce_takes_the_step_rewards_as_per_token_rewards(ray_local, tmp_path, chain_model_dir):
    records = run(tmp_path, chain_model_dir, "reinforce", "learner.advantage=reinforce", "learner.baseline=group_mean",
                  "learner.policy_loss=vanilla", "learner.loss_agg=token-mean")
    for record in records:
        # gamma 1: every token's return counts the rewards (0 or 1) of the steps that end at or after it, at most
        # the two partial sums; the group baseline leaves a non-zero advantage.
        assert 0 < record["returns/mean"] <= 2 and record["advantage/mean_abs"] > 0
