"""Multi-turn episodes through the real loop (real Ray, real vLLM engines, a real HTTP environment service): the
agent_calc preset in float32, and in bfloat16 on two workers asynchronously, a remote environment giving exactly the
in-process run, and the failure policy of environments."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.run.launch import run_training
from rewards.config import EnvironmentConfig
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ENV_METRICS = {"reward/env", "env/turns/mean", "env/calls", "env/invalid_calls", "env/failures", "time/env",
               "response_length/model_tokens", "env/episode_seconds"}


def run(tmp_path: Path, name: str, model_dir: Path, *overrides: str, config: str = "agent_calc",
        env: EnvironmentConfig | None = None) -> list[dict]:
    cfg = load_config(CONFIGS / f"{config}.yaml", [f"run_dir={tmp_path / name}", f"model.path={model_dir}",
                                                  "max_steps=3", "data.prompts_per_step=8", "rollout.num_workers=1",
                                                  *overrides])
    if env is not None:
        cfg = cfg.model_copy(update={"env": env})
    return run_training(cfg, tmp_path / name, str(model_dir), display=False, pool=POOL)


@pytest.fixture(scope="module")
def calc_fp32(ray_local, tmp_path_factory, calc_model_dir):
    return run(tmp_path_factory.mktemp("calc"), "fp32", calc_model_dir)


def test_the_agent_preset_runs_episodes_and_trains_on_model_tokens_only(calc_fp32):
    for record in calc_fp32:
        assert ENV_METRICS <= record.keys()
        assert record["env/failures"] == 0 and record["env/calls"] > 0
        # Model tokens only: the learner's logprobs of them match the engines' (environment tokens are masked out;
        # counted there, their behaviour logprob 0 would be a mismatch of several nats).
        assert record["logprob/mismatch"] < 1e-4 and record["sync/probe_max_diff"] < 1e-4
        assert record["response_length/model_tokens"] <= record["response_length/mean"]
        assert 1 <= record["env/turns/mean"] <= 3
        assert record["reward/mean"] == pytest.approx(record["reward/env"])  # the only source
        assert math.isfinite(record["loss/policy"]) and record["grad_norm"] > 0
    # Some episodes called the tool: their responses hold environment tokens.
    assert any(r["response_length/model_tokens"] < r["response_length/mean"] for r in calc_fp32)


def test_a_remote_environment_gives_the_in_process_run_step_for_step(calc_fp32, tmp_path, calc_model_dir,
                                                                     serve_env):
    _, url = serve_env(["--env", "rewards.environments.examples:Calculator", "--param", "max_calls=2"])
    remote = run(tmp_path, "remote", calc_model_dir, env=EnvironmentConfig(urls=[url]))
    for ours, theirs in zip(calc_fp32, remote):
        for key in ("reward/mean", "env/turns/mean", "env/calls", "response_length/mean", "loss/policy",
                    "grad_norm", "kl/mean"):
            assert ours[key] == theirs[key], key


def test_the_agent_preset_in_bfloat16_on_two_workers_asynchronously(ray_local, tmp_path, calc_model_dir):
    records = run(tmp_path, "bf16", calc_model_dir, "model.dtype=bfloat16", "rollout.num_workers=2",
                  "rollout.max_staleness=1")
    assert [r["async/staleness"] for r in records] == [0, 1, 1]  # step 1 waits for the first batch, then one behind
    for record in records:
        assert ENV_METRICS <= record.keys() and record["env/failures"] == 0 and record["rollout/workers"] == 2
        assert record["rollout/completions"] == 64
        assert record["logprob/mismatch"] < 0.05 and math.isfinite(record["loss/policy"])


def test_failed_episodes_drop_their_groups_and_turn_rewards_train_as_steps(ray_local, tmp_path, demo_model_dir):
    # tests.envs.Counter refuses (raises at reset) every label below 100: those prompts' groups are dropped, counted.
    # (`env.on_failure=fail` stopping the run: tests/unit/test_env_scoring.py.) Its turn rewards (1, 2, 3) are step
    # rewards at each turn's last model token (`env.turn_rewards=steps`: grpo's process advantages).
    [record] = run(tmp_path, "drop", demo_model_dir, "env.spec=tests.envs:Counter", "env.params={fail_below: 100}",
                   "env.on_failure=drop", "env.turn_rewards=steps", "rollout.stop=['=']", "rollout.max_new_tokens=24",
                   "max_steps=1", config="grpo")
    assert record["logprob/mismatch"] < 1e-4 and record["advantage/mean_abs"] > 0
    # The prompts whose label (a sum of two operands in 0..99) is below 100 fail at reset, all G of them.
    assert record["env/dropped_groups"] >= 1 and record["env/failures"] == 8 * record["env/dropped_groups"]
    assert record["rollout/completions"] == 8 * (8 - record["env/dropped_groups"])
    assert record["verifier/dropped_groups"] == 0 and record["reward/env"] > 0
