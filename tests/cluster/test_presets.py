"""Every algorithm preset under configs/ runs through the real loop (real Ray, real vLLM engines, the demo model),
and DAPO's sampling pieces behave as configured: dynamic sampling is bounded and counted, overlong responses lose
reward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS = 3
# Metrics only a preset's algorithm produces: the proof that the preset ran its own algorithm, not the default.
# dr_grpo's proof is its loss normaliser (test_dr_grpo_divides_the_token_sum_by_the_fixed_length).
OWN_METRICS = {
    "ppo": {"loss/value", "value/clip_fraction", "critic/grad_norm", "returns/mean", "kl/mean"},
    "grpo": {"kl/mean"},
    "dr_grpo": set(),
    "dapo": {"sampling/rounds", "sampling/kept_groups", "sampling/surplus_groups", "sampling/dropped_groups",
             "sampling/filler_groups"},
    "rloo": {"kl/mean"},
    "reinforce_pp": {"kl/mean"},
    "gspo": {"seq_clip_fraction", "seq_ratio_mean"},  # the sequence-level ratio's own metrics
    "reinforce": {"kl/mean", "returns/mean"},  # KL in the reward; the Monte-Carlo returns' mean
}


def run_preset(tmp_path, model_dir, name, *overrides):
    config = load_config(CONFIGS / f"{name}.yaml", [
        f"run_dir={tmp_path / name}", f"model.path={model_dir}", f"max_steps={STEPS}", "data.prompts_per_step=8",
        "rollout.num_workers=1", *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False, pool=POOL)


@pytest.fixture(scope="module")
def preset_run(ray_local, tmp_path_factory, demo_model_dir):
    """Records of a preset on the demo model (with overrides), each run once per module."""
    runs: dict[tuple, list[dict]] = {}

    def run(name: str, *overrides: str) -> list[dict]:
        if (name, overrides) not in runs:
            runs[name, overrides] = run_preset(tmp_path_factory.mktemp(name), demo_model_dir, name, *overrides)
        return runs[name, overrides]

    return run


def test_dr_grpo_divides_the_token_sum_by_the_fixed_length(preset_run):
    # Step 1 of dr_grpo against the same step with token-mean aggregation: same seeds and initial weights, so the
    # same completions and advantages, and one update with ratio 1. Dr.GRPO's loss sum_bt l / (B * L) is token-mean's
    # sum_bt l / sum_b |y_b| times (mean length) / L, and so is its gradient, whose norm grad_norm is.
    fixed = preset_run("dr_grpo")[0]
    (token_mean,) = preset_run("dr_grpo", "max_steps=1", "learner.loss_agg=token-mean")
    assert fixed["reward/mean"] == token_mean["reward/mean"]
    assert fixed["response_length/mean"] == token_mean["response_length/mean"]
    length = load_config(CONFIGS / "dr_grpo.yaml").rollout.max_new_tokens  # L: learner.loss_norm_length is unset
    factor = fixed["response_length/mean"] / length
    assert factor < 0.9  # the demo's answers are shorter than L: the check can tell the two normalisers apart
    assert fixed["grad_norm"] == pytest.approx(token_mean["grad_norm"] * factor, rel=1e-4)
    assert fixed["loss/policy"] == pytest.approx(token_mean["loss/policy"] * factor, rel=1e-4, abs=1e-9)


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


# Last, and the presets without a reference first: runs of one fleet shape follow each other (tests/fleets.py).
@pytest.mark.parametrize("name", sorted(OWN_METRICS, key=lambda name: (load_config(CONFIGS / f"{name}.yaml")
                                                                       .uses_reference, name)))
def test_preset_runs_end_to_end(preset_run, name):
    records = preset_run(name)
    assert [r["weights/version"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert OWN_METRICS[name] <= record.keys()
        assert ("kl/mean" in record) == ("kl/mean" in OWN_METRICS[name])  # KL reported exactly when it is on
        assert ("loss/value" in record) == (name == "ppo")
        assert ("returns/mean" in record) == (name in ("ppo", "reinforce"))
        assert ("seq_ratio_mean" in record) == (name == "gspo")
        assert math.isfinite(record["loss/policy"]) and record["grad_norm"] > 0
        assert record["logprob/mismatch"] < 1e-4 and record["sync/probe_max_diff"] < 1e-4
        assert record["train/skipped_updates"] == 0
    if name == "gspo":
        # Its clip range (3e-4, 4e-4) is far below how much a sequence's ratio moves in the second minibatch, which
        # comes after the first one's update: whole sequences are clipped.
        assert max(r["seq_clip_fraction"] for r in records) > 0
