"""Rollout-mismatch correction (TIS / MIS, token and sequence level) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algo.correction import rollout_correction
from learner.algo.losses import clipped_policy_loss, gspo_policy_loss

LN = math.log


def case(old_probs, behavior_probs, mask):
    return (torch.tensor(old_probs).log(), torch.tensor(behavior_probs).log(), torch.tensor(mask, dtype=torch.bool))


# Row 0: rho = [2, 0.5]; row 1: rho = [3, pad]. k3(rho) = rho - 1 - ln rho.
OLD, BEHAVIOR, MASK = case([[0.5, 0.2], [0.6, 0.9]], [[0.25, 0.4], [0.2, 0.1]], [[1, 1], [1, 0]])
K3 = [2 - 1 - LN(2), 0.5 - 1 - LN(0.5), 3 - 1 - LN(3)]


def test_tis_token_caps_each_ratio():
    weights, metrics = rollout_correction(OLD, BEHAVIOR, MASK, "tis", cap=2.5)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5], [2.5, 1.0]]))  # min(rho, 2.5); padding 1
    assert metrics["rollout_correction/weight_mean"].item() == pytest.approx((2 + 0.5 + 2.5) / 3)
    assert metrics["rollout_correction/capped_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["mismatch/kl"].item() == pytest.approx(sum(K3) / 3)


def test_mis_token_drops_ratios_outside_the_band():
    weights, metrics = rollout_correction(OLD, BEHAVIOR, MASK, "mis", cap=2.5)  # band [0.4, 2.5]
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
    assert metrics["rollout_correction/masked_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["rollout_correction/weight_mean"].item() == pytest.approx(2 / 3)
    weights, _ = rollout_correction(OLD, BEHAVIOR, MASK, "mis", cap=1.9)  # 0.5 < 1/1.9 too
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0], [0.0, 1.0]]))


def test_sequence_level_uses_the_product_of_the_ratios():
    weights, metrics = rollout_correction(OLD, BEHAVIOR, MASK, "tis", cap=2.5, level="sequence")
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0], [2.5, 1.0]]))  # row 0: 2 x 0.5 = 1; row 1: 3
    assert metrics["rollout_correction/capped_fraction"].item() == pytest.approx(1 / 3)
    weights, _ = rollout_correction(OLD, BEHAVIOR, MASK, "mis", cap=2.5, level="sequence")
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0], [0.0, 1.0]]))


def test_none_weighs_every_token_one_and_still_reports_the_mismatch():
    weights, metrics = rollout_correction(OLD, BEHAVIOR, MASK, "none", cap=2.0)
    torch.testing.assert_close(weights, torch.ones(2, 2))
    assert set(metrics) == {"mismatch/kl"} and metrics["mismatch/kl"].item() == pytest.approx(sum(K3) / 3)


def test_padding_garbage_and_long_sequences_stay_finite():
    old = torch.tensor([[0.0] * 4 + [float("inf")]])
    behavior = torch.tensor([[-300.0] * 4 + [float("nan")]])  # log rho = 300 per token, 1200 per sequence
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    for level in ("token", "sequence"):
        weights, metrics = rollout_correction(old, behavior, mask, "tis", cap=2.0, level=level)
        torch.testing.assert_close(weights, torch.tensor([[2.0] * 4 + [1.0]]))
        assert metrics["rollout_correction/capped_fraction"].item() == 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "is"}, "unknown rollout correction 'is'"),
    ({"mode": "tis", "cap": 1.0}, "cap must be > 1"),
    ({"mode": "tis", "level": "group"}, "unknown rollout correction level 'group'"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction(OLD, BEHAVIOR, MASK, **{"cap": 2.0, **kwargs})


@pytest.mark.parametrize("loss_fn", [clipped_policy_loss, gspo_policy_loss])
def test_policy_losses_weigh_each_tokens_term(loss_fn):
    """w_t multiplies the token's loss term: a weight of 0 removes its gradient, and all weights c scale the loss."""
    torch.manual_seed(0)
    logprobs = (torch.randn(2, 3) * 0.1 - 1).requires_grad_()
    old = logprobs.detach() + torch.randn(2, 3) * 0.05
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mask = torch.ones(2, 3, dtype=torch.bool)
    plain, _ = loss_fn(logprobs, old, advantages, mask, 0.2, 0.2, mode="token-mean")
    scaled, _ = loss_fn(logprobs, old, advantages, mask, 0.2, 0.2, mode="token-mean", weights=torch.full((2, 3), 1.5))
    assert scaled.item() == pytest.approx(1.5 * plain.item())
    weights = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # the second sequence dropped (mis)
    dropped, _ = loss_fn(logprobs, old, advantages, mask, 0.2, 0.2, mode="token-mean", weights=weights)
    (grad,) = torch.autograd.grad(dropped, logprobs)
    assert torch.all(grad[1] == 0) and torch.all(grad[0] != 0)


def test_mismatch_kl_of_a_float32_rounding_gap_is_tiny_and_not_negative():
    old = torch.full((1, 64), -2.0)
    behavior = old + torch.linspace(-3e-7, 3e-7, 64)  # what float32 engines and learners differ by
    _, metrics = rollout_correction(old, behavior, torch.ones(1, 64, dtype=torch.bool), "none", cap=2.0)
    assert 0 <= metrics["mismatch/kl"].item() < 1e-13
