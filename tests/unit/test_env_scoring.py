"""The scorer's part of multi-turn episodes: environment rewards by weight (outcome or per-turn steps), reward
sources on the final turn's text, and the failure policy of environments."""

from __future__ import annotations

import numpy as np
import pytest

from actors.rollout_types import EpisodeInfo, Rollout
from cluster.demo.task import Problem
from cluster.run.scoring import Scorer
from rewards.config import EnvironmentConfig, RewardConfig
from sync.calls import RunError

ENV = "tests.envs:Counter"


def episode(text: str, turn_rewards: list[float], turn_ends: list[int], length: int, error: str | None = None):
    info = EpisodeInfo(turns=len(turn_rewards), turn_ends=turn_ends, turn_rewards=turn_rewards,
                       calls=1 + len(turn_rewards), invalid_calls=0, truncated_observations=0, env_seconds=0.0,
                       error=error)
    return Rollout([1], list(range(length)), [0.0] * length, text, "stop", 0, model_mask=[1] * length, episode=info)


def groups(error_in_second: str | None = None):
    problems = [Problem("3*4=", "12"), Problem("5*6=", "30")]
    return problems, [
        [episode("12", [0.0, 1.0], [3, 9], 10), episode("11", [0.0], [4], 8)],
        [episode("30", [1.0], [2], 3), episode("1", [0.5, 0.0], [1, 6], 9, error=error_in_second)],
    ]


def test_turn_rewards_sum_into_the_outcome_by_weight_beside_the_sources():
    scorer = Scorer(RewardConfig(), 10, EnvironmentConfig(spec=ENV, weight=2.0))
    problems, rollouts = groups()
    result = scorer.score(problems, rollouts)
    # exact_match on the last turn's text, plus 2 x the episode's total environment reward
    assert result.rewards == [[1.0 + 2.0, 0.0 + 0.0], [1.0 + 2.0, 0.0 + 1.0]]
    assert result.per_source["env"] == [1.0, 0.0, 1.0, 0.5] and result.per_source["correct"] == [1.0, 0.0, 1.0, 0.0]
    assert result.steps is None and result.metrics["env/failures"] == 0 and not any(result.dropped)


def test_turn_rewards_as_steps_end_at_each_answered_turn_and_at_the_last_token():
    scorer = Scorer(RewardConfig(sources={}), 10, EnvironmentConfig(spec=ENV, weight=0.5, turn_rewards="steps"))
    problems, rollouts = groups()
    result = scorer.score(problems, rollouts)
    assert result.rewards == [[0.0, 0.0], [0.0, 0.0]]  # no outcome source: everything is in the steps
    steps = [s for group in result.steps for s in group]
    assert [s.ends.tolist() for s in steps] == [[3, 9], [4, 7], [2], [1, 6, 8]]  # the last token ends a step
    np.testing.assert_array_equal(steps[0].rewards, [0.0, 0.5])
    np.testing.assert_array_equal(steps[1].rewards, [0.0, 0.0])
    np.testing.assert_array_equal(steps[3].rewards, [0.25, 0.0, 0.0])


def test_a_failed_episode_stops_the_run_or_drops_its_group():
    problems, rollouts = groups(error_in_second="environment 'x': step 1 raised RuntimeError: boom")
    with pytest.raises(RunError, match=r"1 episode\(s\) failed in the environment, the first: environment 'x': "
                                       r"step 1 raised RuntimeError: boom \(env.on_failure=fail"):
        Scorer(RewardConfig(), 10, EnvironmentConfig(spec=ENV)).score(problems, rollouts)
    result = Scorer(RewardConfig(), 10, EnvironmentConfig(spec=ENV, on_failure="drop")).score(problems, rollouts)
    assert result.dropped == [False, True]
    assert result.metrics["env/failures"] == 1 and result.metrics["env/dropped_groups"] == 1
    assert result.metrics["verifier/dropped_groups"] == 0
    assert result.per_source["env"] == [1.0, 0.0]  # the kept group's only
