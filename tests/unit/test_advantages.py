"""Advantage estimators against hand-computed values, and the registry against the config's names."""

import math

import pytest
import torch
from torch.testing import assert_close

from learner.algo.advantages import ADVANTAGE_ESTIMATORS, broadcast_to_tokens, group_relative, rloo

EPS = 1e-6


def test_group_relative_std_matches_hand_computed_values():
    # Group 0 = [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25],
    #   unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std = 0.5.
    # Group 1 = [2, 4, 6, 8]: mean 5, deviations [-3, -1, 1, 3], var = (9 + 1 + 1 + 9) / 3 = 20/3.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0], dtype=torch.float64)
    std_1 = math.sqrt(20 / 3)
    expected = torch.tensor(
        [0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS)]
        + [-3 / (std_1 + EPS), -1 / (std_1 + EPS), 1 / (std_1 + EPS), 3 / (std_1 + EPS)],
        dtype=torch.float64,
    )
    assert_close(group_relative(rewards, group_size=4), expected)


def test_group_relative_groups_consecutive_samples():
    # G=2 pairs (1, 3) and (5, 5): [-1, 1] / (sqrt(2) + eps) and [0, 0]. Strided grouping would pair (1, 5), (3, 5).
    rewards = torch.tensor([1.0, 3.0, 5.0, 5.0], dtype=torch.float64)
    s = math.sqrt(2) + EPS
    assert_close(group_relative(rewards, group_size=2), torch.tensor([-1 / s, 1 / s, 0.0, 0.0], dtype=torch.float64))


def test_group_relative_scale_none_is_reward_minus_group_mean():
    # Dr.GRPO: group means 0.25 and 5, no division.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, -3.0, -1.0, 1.0, 3.0])
    assert_close(group_relative(rewards, group_size=4, scale="none"), expected)


def test_group_relative_equal_rewards_and_singleton_groups_give_zero_not_nan():
    assert_close(group_relative(torch.tensor([0.7, 0.7, 0.7]), group_size=3), torch.zeros(3))
    # Groups of one: torch.std would be NaN; GRPO has no baseline, so the advantage is 0.
    singletons = group_relative(torch.tensor([1.0, -2.0, 5.0]), group_size=1)
    assert_close(singletons, torch.zeros(3))


def test_group_relative_accepts_integer_rewards():
    # [1, 0] -> mean 0.5, std sqrt(0.5) -> +-0.5 / (sqrt(0.5) + eps)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert_close(group_relative(torch.tensor([1, 0]), group_size=2), torch.tensor([a, -a]))


def test_rloo_matches_hand_computed_values():
    # Group 0 = [1, 0, 0, 0]: 1 - 0/3 = 1;  0 - (1 + 0 + 0)/3 = -1/3.
    # Group 1 = [2, 4, 6, 8], sum 20: 2 - 18/3 = -4, 4 - 16/3 = -4/3, 6 - 14/3 = 4/3, 8 - 12/3 = 4.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0], dtype=torch.float64)
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, -4.0, -4 / 3, 4 / 3, 4.0], dtype=torch.float64)
    assert_close(rloo(rewards, group_size=4), expected)


def test_rloo_rejects_groups_of_one():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo(torch.tensor([1.0, 2.0]), group_size=1)


@pytest.mark.parametrize("estimator", [group_relative, rloo])
def test_batch_not_divisible_by_group_size_names_both_numbers(estimator):
    with pytest.raises(ValueError, match=r"5 rewards.*group_size 2"):
        estimator(torch.zeros(5), 2)


def test_registry_keys_are_the_config_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo"}


def test_registry_entries_share_one_signature_and_compute_their_estimator():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0])
    assert_close(ADVANTAGE_ESTIMATORS["grpo"](rewards, 4), group_relative(rewards, 4, scale="std"))
    assert_close(ADVANTAGE_ESTIMATORS["rloo"](rewards, 4), rloo(rewards, 4))
    assert not torch.equal(ADVANTAGE_ESTIMATORS["grpo"](rewards, 4), ADVANTAGE_ESTIMATORS["rloo"](rewards, 4))


def test_broadcast_to_tokens_puts_each_advantage_on_its_response_tokens():
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(broadcast_to_tokens(advantages, mask), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    assert_close(broadcast_to_tokens(advantages, mask.bool()), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
