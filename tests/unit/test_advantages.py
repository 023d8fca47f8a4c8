"""Advantage estimators against hand-computed values, and the registry against the config's names."""

import math

import pytest
import torch
from torch.testing import assert_close

from learner.algo.advantages import ADVANTAGE_ESTIMATORS, broadcast_to_tokens, gae, group_relative, reinforce_pp, rloo

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
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce_pp"}


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


# ---------------------------------------------------------------- REINFORCE++

F64 = torch.float64
GARBAGE = 1e4


def test_reinforce_pp_matches_hand_computed_values():
    # G=2 groups (1, 0) and (3, 3): group-centered [0.5, -0.5, 0, 0], batch mean 0,
    #   unbiased batch var = (0.25 + 0.25 + 0 + 0) / 3 = 1/6, std = sqrt(1/6).
    # GRPO would divide group 0 by its own std sqrt(0.5) instead: +-0.707 rather than +-1.2247.
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=F64)
    s = math.sqrt(1 / 6) + EPS
    assert_close(reinforce_pp(rewards, group_size=2), torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0], dtype=F64))


def test_reinforce_pp_subtracts_the_group_mean_before_whitening():
    # Groups (0, 2) and (10, 12): centered [-1, 1, -1, 1] (whitening raw rewards would rank 10 above 2),
    #   batch mean 0, unbiased var = 4 / 3.
    rewards = torch.tensor([0.0, 2.0, 10.0, 12.0], dtype=F64)
    a = 1 / (math.sqrt(4 / 3) + EPS)
    assert_close(reinforce_pp(rewards, group_size=2), torch.tensor([-a, a, -a, a], dtype=F64))


def test_reinforce_pp_constant_batch_and_single_sequence_give_zero_not_nan():
    assert_close(reinforce_pp(torch.tensor([0.7, 0.7, 0.2, 0.2]), group_size=2), torch.zeros(4))
    assert_close(reinforce_pp(torch.tensor([5.0]), group_size=1), torch.zeros(1))


# ---------------------------------------------------------------- GAE


def _gae_loop(token_rewards, values, mask, gamma, lam):
    """Plain-Python GAE, one sequence and one token at a time, over the response tokens only."""
    batch, length = mask.shape
    advantages = [[0.0] * length for _ in range(batch)]
    returns = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        positions = [t for t in range(length) if mask[b, t]]
        next_advantage, next_value = 0.0, 0.0  # after the last response token the episode ends
        for t in reversed(positions):
            delta = float(token_rewards[b, t]) + gamma * next_value - float(values[b, t])
            next_advantage = delta + gamma * lam * next_advantage
            next_value = float(values[b, t])
            advantages[b][t] = next_advantage
            returns[b][t] = next_advantage + next_value
    return torch.tensor(advantages, dtype=F64), torch.tensor(returns, dtype=F64)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0)])
def test_gae_equals_the_plain_loop_on_ragged_batches(gamma, lam):
    generator = torch.Generator().manual_seed(1)
    batch, length = 6, 7
    token_rewards = torch.randn(batch, length, generator=generator, dtype=F64)
    values = torch.randn(batch, length, generator=generator, dtype=F64)
    lengths = torch.tensor([7, 3, 0, 1, 5, 6])  # ragged, including an empty and a full row
    mask = torch.arange(length) < lengths[:, None]
    advantages, returns = gae(token_rewards, values, mask, gamma, lam)
    expected_advantages, expected_returns = _gae_loop(token_rewards, values, mask, gamma, lam)
    assert_close(advantages, expected_advantages)
    assert_close(returns, expected_returns)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


def test_gae_with_gamma_and_lambda_one_is_future_reward_minus_value():
    # Row 0 rewards [0, 0, 1 | pad], V [0.5, 0.2, 0.7]: future sums [1, 1, 1] -> A = [0.5, 0.8, 0.3], R = [1, 1, 1].
    # Row 1 rewards [0.1, 0.2, 0.3, 0.4], V [1, 2, 3, 4]: future sums [1.0, 0.9, 0.7, 0.4]
    #   -> A = [0.0, -1.1, -2.3, -3.6], R = future sums.
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=F64)
    values = torch.tensor([[0.5, 0.2, 0.7, 0.0], [1.0, 2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    advantages, returns = gae(token_rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(advantages, torch.tensor([[0.5, 0.8, 0.3, 0.0], [0.0, -1.1, -2.3, -3.6]], dtype=F64))
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.9, 0.7, 0.4]], dtype=F64))


def test_gae_discounts_with_gamma_and_lambda():
    # gamma = lam = 0.5, rewards [0, 1], V [1, 2]:
    #   t1: delta = 1 + 0.5 * 0 - 2 = -1, A = -1;  t0: delta = 0 + 0.5 * 2 - 1 = 0, A = 0 + 0.25 * -1 = -0.25.
    #   R = A + V = [0.75, 1.0].
    advantages, returns = gae(
        torch.tensor([[0.0, 1.0]], dtype=F64), torch.tensor([[1.0, 2.0]], dtype=F64), torch.ones(1, 2), 0.5, 0.5
    )
    assert_close(advantages, torch.tensor([[-0.25, -1.0]], dtype=F64))
    assert_close(returns, torch.tensor([[0.75, 1.0]], dtype=F64))


def test_gae_ignores_whatever_padding_holds():
    # The value after a row's last response token must be 0 whatever the next (padding) position holds.
    token_rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]], dtype=F64)
    values = torch.tensor([[0.3, 0.6, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    reference = gae(token_rewards, values, mask, 0.9, 0.8)
    padding = ~mask.bool()
    for fill in (GARBAGE, -GARBAGE, math.inf, math.nan):
        garbage_rewards = token_rewards.masked_fill(padding, fill)
        garbage_values = values.masked_fill(padding, -fill)
        assert_close(gae(garbage_rewards, garbage_values, mask, 0.9, 0.8), reference)
        assert_close(gae(garbage_rewards, garbage_values, mask.bool(), 0.9, 0.8), reference)
    # and the reference itself is the hand value: row 1 A = 0.5 - 0.2 = 0.3 (no bootstrap from padding)
    assert_close(reference[0][1, 0], torch.tensor(0.3, dtype=F64))
