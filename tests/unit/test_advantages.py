"""Advantage estimators against hand-computed values, and the registry against the config's names."""

import math

import pytest
import torch
from torch.testing import assert_close

from learner.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    Advantages,
    broadcast_to_tokens,
    carry_to_model_tokens,
    compact,
    discounted_returns,
    gae,
    group_relative,
    last_token_rewards,
    masked_whiten,
    on_model_tokens,
    process_group_relative,
    reinforce,
    reinforce_pp,
    rloo,
    sequence_rewards,
    uncompact,
)

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


def test_broadcast_to_tokens_puts_each_advantage_on_its_response_tokens():
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(broadcast_to_tokens(advantages, mask), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    assert_close(broadcast_to_tokens(advantages, mask.bool()), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- REINFORCE++

F64 = torch.float64
GARBAGE = 1e4


def t(values):
    return torch.tensor(values, dtype=F64)


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


# ---------------------------------------------------------------- masked whitening


def test_masked_whiten_matches_hand_computed_values():
    # Response tokens 1, 2, 3, 4: mean 2.5, deviations [-1.5, -0.5, 0.5, 1.5],
    #   unbiased var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3. Padding holds inf and NaN and must read 0.
    values = t([[1.0, 2.0, 3.0], [4.0, math.inf, math.nan]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    s = math.sqrt(5 / 3) + 1e-8
    expected = t([[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]])
    assert_close(masked_whiten(values, mask), expected)
    assert_close(masked_whiten(values, mask.bool()), expected)


def test_masked_whiten_ignores_whatever_padding_holds_and_gives_it_no_gradient():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    reference = masked_whiten(t([[1.0, 3.0, 0.0], [8.0, 0.0, 0.0]]), mask)
    for fill in (GARBAGE, -GARBAGE, math.inf, math.nan):
        values = t([[1.0, 3.0, fill], [8.0, fill, -fill]]).requires_grad_()
        whitened = masked_whiten(values, mask)
        assert_close(whitened, reference)
        (grad,) = torch.autograd.grad((whitened * t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).sum(), values)
        assert torch.isfinite(grad).all()
        assert (grad[~mask.bool()] == 0).all()


def test_masked_whiten_of_fewer_than_two_tokens_or_constant_values_is_zero_not_nan():
    assert_close(masked_whiten(t([[5.0, math.nan]]), torch.tensor([[1, 0]])), t([[0.0, 0.0]]))  # one token
    assert_close(masked_whiten(t([[5.0, math.inf]]), torch.tensor([[0, 0]])), t([[0.0, 0.0]]))  # none
    # constant values: std 0, (v - mean) / (0 + eps) = 0; and the gradient stays finite (no sqrt'(0) = inf)
    values = t([[0.7, 0.7], [0.7, 0.0]]).requires_grad_()
    whitened = masked_whiten(values, torch.tensor([[1, 1], [1, 0]]))
    assert_close(whitened, torch.zeros(2, 2, dtype=F64))
    (grad,) = torch.autograd.grad(whitened.sum(), values)
    assert torch.isfinite(grad).all()


# ---------------------------------------------------------------- last-token rewards


def test_last_token_rewards_put_each_reward_on_its_last_response_token():
    # Row 0 ends at t=1, row 1 at t=0, row 2 at t=2 (full), row 3 has no response token: its reward is dropped.
    rewards = t([1.0, -2.0, 5.0, 7.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    expected = t([[0.0, 1.0, 0.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]])
    assert_close(last_token_rewards(rewards, mask), expected)
    assert_close(last_token_rewards(rewards, mask.bool()), expected)
    # and summing them back over the response tokens returns each reward (but the dropped one)
    assert_close(sequence_rewards(expected, mask), t([1.0, -2.0, 5.0, 0.0]))


def test_last_token_rewards_accept_integer_rewards_and_reject_mismatched_shapes():
    integer_rewards = last_token_rewards(torch.tensor([1, 0]), torch.tensor([[1, 1], [1, 0]]))
    assert_close(integer_rewards, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"rewards \[B\] and mask \[B, T\]"):
        last_token_rewards(torch.zeros(3), torch.ones(2, 4))


# ---------------------------------------------------------------- the registry

# Two prompts, G = 2, outcome rewards [1, 0 | 3, 3] on the last response token of rows with 2, 1, 3, 2 tokens.
REGISTRY_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
REGISTRY_REWARDS = [1.0, 0.0, 3.0, 3.0]


def _spread(per_sequence):
    """Hand-written [B] -> [B, T] on REGISTRY_MASK (rows of 2, 1, 3, 2 tokens)."""
    a, b, c, d = per_sequence
    return t([[a, a, 0.0], [b, 0.0, 0.0], [c, c, c], [d, d, 0.0]])


def _registry_inputs(**kwargs):
    token_rewards = last_token_rewards(t(REGISTRY_REWARDS), REGISTRY_MASK)
    return AdvantageInputs(token_rewards=token_rewards, mask=REGISTRY_MASK, group_size=2, **kwargs)


def test_registry_keys_are_the_config_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce_pp", "gae", "reinforce", "distill"}


def test_registry_grpo_entry_computes_group_relative_on_each_token():
    # Group (1, 0): mean 0.5, std sqrt(0.5) -> +-0.5 / (sqrt(0.5) + eps); group (3, 3): 0.
    a = 0.5 / (math.sqrt(0.5) + EPS)
    result = ADVANTAGE_ESTIMATORS["grpo"](_registry_inputs())
    assert isinstance(result, Advantages) and result.returns is None
    assert_close(result.advantages, _spread([a, -a, 0.0, 0.0]))
    assert_close(result.advantages, broadcast_to_tokens(group_relative(t(REGISTRY_REWARDS), 2), REGISTRY_MASK))


def test_registry_grpo_entry_with_scale_none_is_dr_grpo():
    # Group means 0.5 and 3, no division.
    result = ADVANTAGE_ESTIMATORS["grpo"](_registry_inputs(scale="none"))
    assert_close(result.advantages, _spread([0.5, -0.5, 0.0, 0.0]))


def test_registry_rloo_entry_computes_leave_one_out():
    # G = 2: each reward minus the other one: 1 - 0, 0 - 1, 3 - 3, 3 - 3.
    result = ADVANTAGE_ESTIMATORS["rloo"](_registry_inputs())
    assert result.returns is None
    assert_close(result.advantages, _spread([1.0, -1.0, 0.0, 0.0]))


def test_registry_reinforce_pp_entry_whitens_over_the_batch():
    # Group-centred [0.5, -0.5, 0, 0], batch mean 0, unbiased var (0.25 + 0.25) / 3 = 1/6.
    a = 0.5 / (math.sqrt(1 / 6) + EPS)
    result = ADVANTAGE_ESTIMATORS["reinforce_pp"](_registry_inputs())
    assert result.returns is None
    assert_close(result.advantages, _spread([a, -a, 0.0, 0.0]))
    assert_close(result.advantages, broadcast_to_tokens(reinforce_pp(t(REGISTRY_REWARDS), 2), REGISTRY_MASK))


def test_registry_sequence_estimators_subtract_a_per_token_penalty_from_the_sequence_reward():
    # KL in reward: token_rewards = outcome on the last token - beta * kl_t, with beta * kl_t per row:
    #   [0.1, 0.2], [0.3], [0.0, 0.1, 0.1], [0.2, 0.2]; padding holds garbage and must not count.
    # Sequence rewards: 1 - 0.3 = 0.7, 0 - 0.3 = -0.3 | 3 - 0.2 = 2.8, 3 - 0.4 = 2.6.
    penalty = t([[0.1, 0.2, GARBAGE], [0.3, math.inf, -GARBAGE], [0.0, 0.1, 0.1], [0.2, 0.2, math.nan]])
    token_rewards = last_token_rewards(t(REGISTRY_REWARDS), REGISTRY_MASK) - penalty
    inputs = AdvantageInputs(token_rewards=token_rewards, mask=REGISTRY_MASK, group_size=2)
    assert_close(sequence_rewards(token_rewards, REGISTRY_MASK), t([0.7, -0.3, 2.8, 2.6]))
    # rloo: 0.7 - (-0.3) = 1.0, -0.3 - 0.7 = -1.0 | 2.8 - 2.6 = 0.2, 2.6 - 2.8 = -0.2
    assert_close(ADVANTAGE_ESTIMATORS["rloo"](inputs).advantages, _spread([1.0, -1.0, 0.2, -0.2]))
    # Dr.GRPO: group means 0.2 and 2.7 -> [0.5, -0.5 | 0.1, -0.1]
    dr_grpo = ADVANTAGE_ESTIMATORS["grpo"](AdvantageInputs(token_rewards, REGISTRY_MASK, 2, scale="none"))
    assert_close(dr_grpo.advantages, _spread([0.5, -0.5, 0.1, -0.1]))
    # GRPO: both groups have std sqrt(2 * 0.5^2) = sqrt(0.5) and sqrt(2 * 0.1^2) = 0.1 * sqrt(2)
    a, b = 0.5 / (math.sqrt(0.5) + EPS), 0.1 / (0.1 * math.sqrt(2) + EPS)
    assert_close(ADVANTAGE_ESTIMATORS["grpo"](inputs).advantages, _spread([a, -a, b, -b]))
    # REINFORCE++: centred [0.5, -0.5, 0.1, -0.1], batch mean 0, unbiased var (0.25 + 0.25 + 0.01 + 0.01) / 3
    c = math.sqrt(0.52 / 3) + EPS
    reinforce = ADVANTAGE_ESTIMATORS["reinforce_pp"](inputs)
    assert_close(reinforce.advantages, _spread([0.5 / c, -0.5 / c, 0.1 / c, -0.1 / c]))


def test_registry_gae_entry_whitens_advantages_but_not_returns():
    # gamma = lam = 1, so A_t = (sum of rewards from t on) - V_t and R_t = A_t + V_t.
    #   Row 0: rewards [0, 1], V [0, 0] -> A = [1, 1], R = [1, 1].
    #   Row 1: rewards [0, 0 | pad], V [1, 1 | pad] -> t1: 0 + 0 - 1 = -1; t0: 0 + 1 - 1 + (-1) = -1; R = [0, 0].
    # Whitened over the 4 tokens [1, 1, -1, -1]: mean 0, unbiased var 4/3 -> +-1 / (sqrt(4/3) + 1e-8).
    token_rewards = t([[0.0, 1.0, 0.0], [0.0, 0.0, math.inf]])
    values = t([[0.0, 0.0, 0.0], [1.0, 1.0, math.nan]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    inputs = AdvantageInputs(token_rewards=token_rewards, mask=mask, group_size=2, values=values, gamma=1.0, lam=1.0)
    result = ADVANTAGE_ESTIMATORS["gae"](inputs)
    w = 1 / (math.sqrt(4 / 3) + 1e-8)
    assert_close(result.advantages, t([[w, w, 0.0], [-w, -w, 0.0]]))
    assert_close(result.returns, t([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    unwhitened, returns = gae(token_rewards, values, mask, 1.0, 1.0)
    assert_close(result.advantages, masked_whiten(unwhitened, mask))
    assert_close(result.returns, returns)


def test_registry_gae_entry_uses_gamma_and_lambda():
    # gamma = lam = 0.5 on rewards [0, 1], V [1, 2]: A = [-0.25, -1.0], R = [0.75, 1.0] (see the GAE tests above);
    # whitened: mean -0.625, deviations +-0.375, unbiased var 2 * 0.375^2 -> std 0.375 sqrt(2) -> +-1 / sqrt(2).
    inputs = AdvantageInputs(t([[0.0, 1.0]]), torch.ones(1, 2), 1, values=t([[1.0, 2.0]]), gamma=0.5, lam=0.5)
    result = ADVANTAGE_ESTIMATORS["gae"](inputs)
    w = 0.375 / (0.375 * math.sqrt(2) + 1e-8)
    assert_close(result.advantages, t([[w, -w]]))
    assert_close(result.returns, t([[0.75, 1.0]]))


def test_registry_gae_entry_without_values_names_them():
    with pytest.raises(ValueError, match="gae.*values"):
        ADVANTAGE_ESTIMATORS["gae"](_registry_inputs())


def test_discounted_returns_match_hand_computed_values_and_ignore_padding():
    # gamma = 0.5. Row 0: rewards (0, 0, 1) then padding holding inf: G = (0.25, 0.5, 1), 0 at padding.
    # Row 1: rewards (1, 0, 2, 0): G_3 = 0, G_2 = 2, G_1 = 0 + 0.5 * 2 = 1, G_0 = 1 + 0.5 * 1 = 1.5.
    rewards = torch.tensor([[0.0, 0.0, 1.0, math.inf], [1.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert_close(discounted_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.5, 1.0, 0.0], [1.5, 1.0, 2.0, 0.0]]))
    # gamma = 1: every token's return is the sum of the rewards from it on (the outcome for an outcome reward).
    assert_close(discounted_returns(rewards, mask, 1.0), torch.tensor([[1.0, 1.0, 1.0, 0.0], [3.0, 2.0, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="gamma in"):
        discounted_returns(rewards, mask, 1.5)


RETURNS = torch.tensor([[1.0, 1.0], [0.0, 0.0], [3.0, 2.0], [1.0, 1.0]])  # G_t of 4 sequences, groups of 2
ALL = torch.ones(4, 2)


def test_reinforce_without_a_baseline_is_the_return():
    assert_close(reinforce(RETURNS, ALL, 2, "none"), RETURNS)


def test_reinforce_batch_mean_baseline_is_the_mean_total_return_of_the_batch():
    # G_0 = (1, 0, 3, 1): mean 1.25, subtracted from every token's return.
    assert_close(reinforce(RETURNS, ALL, 2, "batch_mean"), RETURNS - 1.25)


def test_reinforce_group_mean_baseline_is_the_mean_total_return_of_the_prompts_group():
    # Groups (1, 0) -> mean 0.5 and (3, 1) -> mean 2.
    expected = torch.tensor([[0.5, 0.5], [-0.5, -0.5], [1.0, 0.0], [-1.0, -1.0]])
    assert_close(reinforce(RETURNS, ALL, 2, "group_mean"), expected)


def test_reinforce_value_baseline_is_the_value_of_each_token():
    values = torch.tensor([[0.5, 0.25], [0.0, 1.0], [2.0, 2.0], [-1.0, 0.0]])
    assert_close(reinforce(RETURNS, ALL, 2, "value", values), RETURNS - values)
    with pytest.raises(ValueError, match="needs values"):
        reinforce(RETURNS, ALL, 2, "value")


def test_registry_reinforce_entry_discounts_then_subtracts_the_group_baseline():
    # Outcome rewards 1 and 0 on the last of 2 tokens, gamma 0.5: G = (0.5, 1) and (0, 0); G_0 = (0.5, 0), group
    # mean 0.25: A = (0.25, 0.75) and (-0.25, -0.25). A shorter third row (1 token, reward 2) with a fourth (reward
    # 0): G_0 = (2, 0), mean 1: A = (1, 0 at padding) and (-1, -1).
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])
    token_rewards = last_token_rewards(torch.tensor([1.0, 0.0, 2.0, 0.0]), mask)
    out = ADVANTAGE_ESTIMATORS["reinforce"](AdvantageInputs(token_rewards=token_rewards, mask=mask, group_size=2,
                                                            gamma=0.5, baseline="group_mean"))
    assert_close(out.advantages, torch.tensor([[0.25, 0.75], [-0.25, -0.25], [1.0, 0.0], [-1.0, -1.0]]))
    assert_close(out.returns, torch.tensor([[0.5, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, 0.0]]))  # G_t, for returns/mean
    valued = ADVANTAGE_ESTIMATORS["reinforce"](AdvantageInputs(
        token_rewards=token_rewards, mask=mask, group_size=2, gamma=0.5, baseline="value",
        values=torch.full((4, 2), 0.5)))
    assert_close(valued.returns, out.returns)  # the critic's targets
    assert_close(valued.advantages, torch.tensor([[0.0, 0.5], [-0.5, -0.5], [1.5, 0.0], [-0.5, -0.5]]))


def test_process_supervision_normalises_the_groups_step_rewards_and_sums_them_from_each_token_on():
    # One group of 2 outputs. Output 0: steps ending at tokens 1 and 3 with rewards 1 and 0; output 1: one step
    # ending at token 2 with reward 1, token 3 padding. The group's step rewards (1, 0, 1): mean 2/3, Bessel std
    # sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3); normalised (0.5774, -1.1547, 0.5774).
    # Output 0: A = (r0 + r1, r0 + r1, r1, r1) = (-0.5774, -0.5774, -1.1547, -1.1547); output 1: (0.5774 x 3, 0).
    step_rewards = torch.tensor([[9.0, 1.0, 9.0, 0.0], [9.0, 9.0, 1.0, math.nan]])  # 9, nan: not a step end
    step_ends = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    a = 1 / 3 / math.sqrt(1 / 3)
    expected = torch.tensor([[a - 2 * a, a - 2 * a, -2 * a, -2 * a], [a, a, a, 0.0]])
    assert_close(process_group_relative(step_rewards, step_ends, mask, 2), expected, atol=1e-5, rtol=0)


def test_process_supervision_with_equal_step_rewards_or_one_step_gives_zero_and_groups_are_separate():
    mask = torch.ones(4, 3)
    ends = torch.tensor([[0, 0, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0]])
    rewards = torch.tensor([[0.0, 0.0, 2.0], [0.0, 2.0, 2.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]])
    out = process_group_relative(rewards, ends, mask, 2)
    assert torch.equal(out, torch.zeros(4, 3))  # group 0: all equal; group 1: a single step
    with pytest.raises(ValueError, match="not a response token"):
        process_group_relative(rewards, ends, torch.tensor([[1, 1, 0]] * 4), 2)
    with pytest.raises(ValueError, match="not divisible by group_size 3"):
        process_group_relative(rewards, ends, mask, 3)


def test_grpo_with_step_ends_is_process_supervision_with_the_outcome_as_the_last_steps_reward():
    # One group of 2 outputs of 3 tokens. Output 0: steps end at tokens 1 (reward 1) and 2 (reward 0, plus the
    # outcome reward 1 on the last token); output 1: one step ending at token 2, reward 0. The group's step rewards
    # (1, 1, 0): mean 2/3, Bessel std sqrt(1/3); normalised (a, a, -2a) with a = (1/3) / sqrt(1/3).
    mask = torch.ones(2, 3)
    ends = torch.tensor([[False, True, True], [False, False, True]])
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]) + last_token_rewards(torch.tensor([1.0, 0.0]),
                                                                                           mask)
    a = (1 / 3) / math.sqrt(1 / 3)
    out = ADVANTAGE_ESTIMATORS["grpo"](AdvantageInputs(token_rewards=token_rewards, mask=mask, group_size=2,
                                                       step_ends=ends))
    assert out.returns is None
    assert_close(out.advantages, torch.tensor([[2 * a, 2 * a, a], [-2 * a] * 3]), atol=1e-5, rtol=0)
    centred = ADVANTAGE_ESTIMATORS["grpo"](AdvantageInputs(token_rewards=token_rewards, mask=mask, group_size=2,
                                                           scale="none", step_ends=ends))  # Dr.GRPO: no std
    assert_close(centred.advantages, torch.tensor([[2 / 3, 2 / 3, 1 / 3], [-2 / 3] * 3]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="scale must be 'std' or 'none'"):
        process_group_relative(token_rewards, ends, mask, 2, scale="max")


def test_gae_and_reinforce_read_step_rewards_where_they_lie():
    # REINFORCE, gamma 1, no baseline: G_t sums the step rewards at and after t plus the outcome: row 0 gets
    # (1 + 0 + 1, 0 + 1, 1) from a step reward 1 at token 0 and the outcome 1 at token 2.
    mask = torch.ones(1, 3)
    token_rewards = torch.tensor([[1.0, 0.0, 0.0]]) + last_token_rewards(torch.tensor([1.0]), mask)
    out = ADVANTAGE_ESTIMATORS["reinforce"](AdvantageInputs(token_rewards=token_rewards, mask=mask, group_size=1,
                                                            step_ends=torch.tensor([[True, False, True]])))
    assert_close(out.advantages, torch.tensor([[2.0, 1.0, 1.0]]))


# Multi-turn episodes: the model's tokens (1) with the environment's (0) between them, right-padded.
EPISODE_MASK = torch.tensor([[1, 1, 0, 0, 1, 0],  # turn 1 (2 tokens), 2 environment tokens, turn 2 (1 token), pad
                             [1, 0, 1, 1, 0, 0],  # trailing padding after turn 2
                             [1, 1, 1, 0, 0, 0],  # one turn, no environment token
                             [0, 0, 0, 0, 0, 0]])  # an empty row


def test_compact_gathers_each_rows_kept_entries_to_the_left_in_order():
    values = torch.arange(24.0).view(4, 6)
    compacted, index = compact(values, EPISODE_MASK)
    assert compacted.tolist() == [[0, 1, 4], [6, 8, 9], [12, 13, 14], [0, 0, 0]]
    assert index.tolist() == [[0, 1, 4], [0, 2, 3], [0, 1, 2], [6, 6, 6]]  # 6 = T: padding, no column
    assert torch.equal(uncompact(compacted, index, 6), torch.where(EPISODE_MASK.bool(), values, 0.0))
    ends, _ = compact(torch.tensor([[True, False, True, True]]), torch.tensor([[0, 1, 1, 0]]))
    assert ends.dtype == torch.bool and ends.tolist() == [[False, True]]  # any dtype; padding is False


@pytest.mark.parametrize("seed", range(5))
def test_compact_round_trips_random_masks_with_holes_and_empty_rows(seed):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(7, 9, generator=generator) < 0.5
    mask[seed % 7] = False  # an empty row
    values = torch.randn(7, 9, generator=generator)
    compacted, index = compact(values, mask.float())
    counts = mask.sum(dim=1)
    assert compacted.shape == (7, int(counts.max())) and torch.equal((index < 9).sum(dim=1), counts)
    for row in range(7):  # the loop version: the kept entries in order, then 0
        kept = values[row][mask[row]]
        assert torch.equal(compacted[row, : len(kept)], kept) and not compacted[row, len(kept):].any()
    assert torch.equal(uncompact(compacted, index, 9), torch.where(mask, values, 0.0))


def test_compact_of_nothing_kept_is_empty_and_uncompacts_to_zeros():
    compacted, index = compact(torch.ones(3, 4), torch.zeros(3, 4))
    assert compacted.shape == index.shape == (3, 0)
    assert torch.equal(uncompact(compacted, index, 4), torch.zeros(3, 4))
    assert compact(torch.ones(0, 4), torch.zeros(0, 4))[0].shape == (0, 0)
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        compact(torch.ones(3, 4), torch.ones(3, 5))


def test_carry_moves_what_lies_on_environment_tokens_to_the_model_token_before_them():
    response = torch.tensor([[0, 1, 1, 1, 1, 1, 0]])  # a prompt position, 5 response tokens, padding
    model = torch.tensor([[0, 0, 1, 0, 0, 1, 0]])  # response tokens 1 and 4 are the model's; 0, 2, 3 the environment's
    values = torch.tensor([[9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0]])
    # 1.0 lies before any model token: dropped; 3.0 and 4.0 go to the model token at 2 (2 + 3 + 4); 9s are not response
    assert carry_to_model_tokens(values, response, model).tolist() == [[0.0, 0.0, 9.0, 0.0, 0.0, 5.0, 0.0]]
    assert torch.equal(carry_to_model_tokens(values, response, response), torch.where(response.bool(), values, 0.0))


def model_only(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The rows' model-token values as a plain right-padded batch (what a batch without environment tokens holds)."""
    out = torch.zeros(mask.shape[0], int(mask.sum(dim=1).max()), dtype=values.dtype)
    for row in range(mask.shape[0]):
        kept = values[row][mask[row].bool()]
        out[row, : len(kept)] = kept
    return out


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "gae", "reinforce"])
def test_every_estimator_on_model_tokens_is_the_estimator_on_the_model_tokens_alone(name):
    """The episode layout (garbage on environment tokens) gives, at each model token, exactly what the estimator
    gives on a batch of the model tokens alone, and 0 on the environment's."""
    generator = torch.Generator().manual_seed(0)
    mask = EPISODE_MASK.float()
    garbage = torch.where(mask.bool(), 0.0, 1e6)
    token_rewards = last_token_rewards(torch.tensor([1.0, 0.0, 0.5, 0.0]), mask) + garbage
    values = torch.randn(4, 6, generator=generator) + garbage
    ends = mask.bool() & (torch.rand(4, 6, generator=generator) < 0.5)
    inputs = AdvantageInputs(token_rewards=token_rewards, mask=mask, group_size=2, values=values, gamma=0.9, lam=0.8,
                             baseline="group_mean", step_ends=ends if name == "grpo" else None)
    ours = on_model_tokens(ADVANTAGE_ESTIMATORS[name], inputs)
    plain_mask = model_only(mask, mask)
    theirs = ADVANTAGE_ESTIMATORS[name](AdvantageInputs(
        token_rewards=model_only(mask, token_rewards), mask=plain_mask, group_size=2, values=model_only(mask, values),
        gamma=0.9, lam=0.8, baseline="group_mean", step_ends=model_only(mask, ends) if name == "grpo" else None))
    assert torch.equal(model_only(mask, ours.advantages), theirs.advantages)
    assert not ours.advantages[~mask.bool()].any() and ours.advantages.abs().sum() > 0
    assert (ours.returns is None) == (theirs.returns is None)
    if ours.returns is not None:
        assert torch.equal(model_only(mask, ours.returns), theirs.returns) and not ours.returns[~mask.bool()].any()


def test_gae_on_model_tokens_chains_one_turn_to_the_next_by_hand():
    """Model tokens at 0, 1 and 3, the environment's at 2; gamma 0.5, lambda 1, the outcome 1 on token 3, V = (0.5,
    0.25, 99, 0.5). On the model tokens (r = 0, 0, 1; V = 0.5, 0.25, 0.5):
        t=3: delta = 1 - 0.5 = 0.5,                 A = 0.5,                    R = 1.0
        t=1: delta = 0 + 0.5 x 0.5 - 0.25 = 0,      A = 0 + 0.5 x 0.5 = 0.25,   R = 0.5
        t=0: delta = 0 + 0.5 x 0.25 - 0.5 = -0.375, A = -0.375 + 0.5 x 0.25 = -0.25, R = 0.25
    The environment's token gets 0 and its value (99) is never read."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])

    def plain_gae(inputs: AdvantageInputs) -> Advantages:  # GAE without the whitening, to see the values
        return Advantages(*gae(inputs.token_rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam))

    inputs = AdvantageInputs(token_rewards=last_token_rewards(torch.tensor([1.0]), mask), mask=mask, group_size=1,
                             values=torch.tensor([[0.5, 0.25, 99.0, 0.5]]), gamma=0.5, lam=1.0)
    out = on_model_tokens(plain_gae, inputs)
    assert out.advantages.tolist() == [[-0.25, 0.25, 0.0, 0.5]]
    assert out.returns.tolist() == [[0.25, 0.5, 0.0, 1.0]]
    # Without compaction the hole would end the episode at token 1: its advantage would not see turn 2's reward.
    assert plain_gae(inputs).advantages[0, 1] != 0.25


def test_reinforce_on_model_tokens_discounts_per_model_token():
    # Model tokens 0 and 3 (the environment's 1, 2), the outcome 1 on token 3, gamma 0.5: G = (0.5, 0, 0, 1).
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    inputs = AdvantageInputs(token_rewards=last_token_rewards(torch.tensor([1.0]), mask), mask=mask, group_size=1,
                             gamma=0.5)
    out = on_model_tokens(ADVANTAGE_ESTIMATORS["reinforce"], inputs)
    assert out.advantages.tolist() == out.returns.tolist() == [[0.5, 0.0, 0.0, 1.0]]
