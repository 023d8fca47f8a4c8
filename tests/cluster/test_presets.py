"""Every algorithm preset under configs/ runs through the real loop (real Ray, real vLLM engines, the demo model),
and DAPO's sampling pieces behave as configured: dynamic sampling is bounded and counted, overlong responses lose
reward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.driver import run_training

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS = 3
# Metrics only a preset's algorithm produces: the proof that the preset ran its own algorithm, not the default.
OWN_METRICS = {
    "ppo": {"loss/value", "value/clip_fraction", "critic/grad_norm", "returns/mean", "kl/mean"},
    "grpo": {"kl/mean"},
    "dr_grpo": set(),
    "dapo": {"sampling/rounds", "sampling/kept_groups", "sampling/surplus_groups", "sampling/dropped_groups",
             "sampling/filler_groups"},
    "rloo": {"kl/mean"},
    "reinforce_pp": {"kl/mean"},
    "gspo": set(),
}


def run_preset(tmp_path, model_dir, name, *overrides):
    config = load_config(CONFIGS / f"{name}.yaml", [
        f"run_dir={tmp_path / name}", f"model.path={model_dir}", f"max_steps={STEPS}", "data.prompts_per_step=8",
        "rollout.num_workers=1", *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False)


@pytest.mark.parametrize("name", sorted(OWN_METRICS))
def test_preset_runs_end_to_end(ray_local, tmp_path, demo_model_dir, name):
    records = run_preset(tmp_path, demo_model_dir, name)
    assert [r["weights/version"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert OWN_METRICS[name] <= record.keys()
        assert ("kl/mean" in record) == ("kl/mean" in OWN_METRICS[name])  # KL reported exactly when it is on
        assert ("loss/value" in record) == (name == "ppo")
        assert math.isfinite(record["loss/policy"]) and record["grad_norm"] > 0
        assert record["logprob/mismatch"] < 1e-4 and record["sync/probe_max_diff"] < 1e-4
        assert record["train/skipped_updates"] == 0


def test_dynamic_sampling_is_bounded_and_tops_up_the_batch(ray_local, tmp_path, tiny_model_dir):
    # A random model never answers right: every group's rewards are all 0, so every group is dropped, sampling stops
    # after max_sampling_rounds rounds, and the batch is filled with dropped groups, all counted.
    records = run_preset(tmp_path, tiny_model_dir, "dapo", "rollout.max_sampling_rounds=2", "reward.overlong_buffer=0",
                         "max_steps=1")
    (record,) = records
    assert record["sampling/rounds"] == 2
    assert record["sampling/dropped_groups"] == 16 and record["sampling/kept_groups"] == 0
    assert record["sampling/filler_groups"] == 8
    assert record["reward/mean"] == 0 and record["advantage/mean_abs"] == 0


def test_dynamic_sampling_keeps_informative_groups(ray_local, tmp_path, demo_model_dir):
    records = run_preset(tmp_path, demo_model_dir, "dapo", "data.prompts_per_step=16")
    for record in records:
        kept, filler = record["sampling/kept_groups"], record["sampling/filler_groups"]
        assert kept + filler == 16 and kept > 0
        # Rounds go on only while groups are missing: a full first round needs no second one.
        assert record["sampling/rounds"] == 1 or record["sampling/dropped_groups"] > 0
    assert sum(r["sampling/dropped_groups"] for r in records) > 0  # the base model solves some prompts 8 times of 8


def test_overlong_responses_lose_reward(ray_local, tmp_path, tiny_model_dir):
    # The random model rarely ends a response (eos is 1 of 17 tokens), so most responses reach max_new_tokens = 8 and
    # lose the full penalty; the verifier's own reward is 0 for all of them.
    records = run_preset(tmp_path, tiny_model_dir, "dapo", "rollout.dynamic_sampling=false", "reward.overlong_buffer=3",
                         "reward.overlong_penalty=0.5", "max_steps=1")
    (record,) = records
    assert record["response/truncated_fraction"] > 0.3
    assert -0.5 <= record["reward/mean"] <= -0.5 * record["response/truncated_fraction"]
