"""Rollout-mismatch correction (TIS / MIS, token and sequence level; IcePop; sequence-masked TIS) against hand-computed
values, and the gradient each weight leaves a token."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algo.correction import rollout_correction
from learner.algo.losses import (
    POLICY_LOSSES,
    cispo_policy_loss,
    clipped_policy_loss,
    gspo_policy_loss,
    vanilla_policy_loss,
)

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
    ({"mode": "icepop", "level": "sequence"}, "icepop has its own level"),
    ({"mode": "seq_mask_tis", "low": 2.0, "high": 1.0}, "needs a band 0 <= low < high"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction(OLD, BEHAVIOR, MASK, **{"cap": 2.0, **kwargs})


@pytest.mark.parametrize("loss_fn", [clipped_policy_loss, gspo_policy_loss, vanilla_policy_loss, cispo_policy_loss])
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


# ---------------------------------------------------------------- IcePop and sequence-masked TIS


def test_icepop_weighs_by_the_ratio_inside_the_band_and_masks_both_ends():
    # rho = [2, 0.5], [3, pad]; band [0.4, 2.5]: 2 and 0.5 inside (weight rho), 3 above (weight 0).
    weights, metrics = rollout_correction(OLD, BEHAVIOR, MASK, "icepop", cap=2.0, low=0.4, high=2.5)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5], [0.0, 1.0]]))
    assert metrics["rollout_correction/weight_mean"].item() == pytest.approx((2 + 0.5 + 0) / 3)
    assert metrics["rollout_correction/masked_fraction"].item() == pytest.approx(1 / 3)
    assert set(metrics) == {"mismatch/kl", "rollout_correction/weight_mean", "rollout_correction/masked_fraction"}
    # band [0.6, 2.5]: 0.5 is now below it, masked too; the cap plays no part
    weights, metrics = rollout_correction(OLD, BEHAVIOR, MASK, "icepop", cap=1.1, low=0.6, high=2.5)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    assert metrics["rollout_correction/masked_fraction"].item() == pytest.approx(2 / 3)


def test_icepop_gives_a_token_outside_the_band_no_gradient():
    """The weights into the PPO loss at r = 1 (one update per batch): d l / d log pi_t = -A_t w_t / N, so 0 exactly
    where the token was masked, and rho_t times PPO's gradient elsewhere."""
    old, behavior, mask = (x.double() if x.is_floating_point() else x for x in (OLD, BEHAVIOR, MASK))
    weights, _ = rollout_correction(old, behavior, mask, "icepop", cap=2.0, low=0.4, high=2.5)  # [[2, .5], [0, 1]]
    logprobs = old.clone().requires_grad_()
    advantages = torch.tensor([[1.0, -1.0], [2.0, 0.0]], dtype=torch.float64)
    loss, _ = clipped_policy_loss(logprobs, old, advantages, mask, 0.2, 0.2, weights=weights)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # token mean over 3 tokens: -1 * 2 / 3, +1 * 0.5 / 3, masked 0, padding 0
    torch.testing.assert_close(grad, torch.tensor([[-2 / 3, 0.5 / 3], [0.0, 0.0]], dtype=torch.float64))
    assert grad[1, 0].item() == 0.0  # exactly: the masked token's advantage is 2, it would move otherwise


# Row 0: rho = [2, 0.5] (geometric mean 1); row 1: [3, pad] (3); row 2: [1.5, 1.5] (1.5). 5 response tokens.
SEQ_OLD, SEQ_BEHAVIOR, SEQ_MASK = case([[0.5, 0.2], [0.6, 0.9], [0.3, 0.3]], [[0.25, 0.4], [0.2, 0.1], [0.2, 0.2]],
                                       [[1, 1], [1, 0], [1, 1]])


def test_seq_mask_tis_masks_whole_sequences_by_their_geometric_mean_and_truncates_the_rest_per_token():
    # band [0.5, 1.4]: rows 1 (3) and 2 (1.5) masked, though row 2's tokens are each under the cap;
    # row 0 kept, its tokens capped at 1.8: [min(2, 1.8), 0.5].
    weights, metrics = rollout_correction(SEQ_OLD, SEQ_BEHAVIOR, SEQ_MASK, "seq_mask_tis", cap=1.8, low=0.5, high=1.4)
    torch.testing.assert_close(weights, torch.tensor([[1.8, 0.5], [0.0, 1.0], [0.0, 0.0]]))
    assert metrics["rollout_correction/masked_fraction"].item() == pytest.approx(3 / 5)
    # row 1's 3 is masked, not capped
    assert metrics["rollout_correction/capped_fraction"].item() == pytest.approx(1 / 5)
    assert metrics["rollout_correction/weight_mean"].item() == pytest.approx((1.8 + 0.5) / 5)
    # band [0.5, 1.6]: row 2 is kept, each token min(1.5, 1.8) = 1.5
    weights, metrics = rollout_correction(SEQ_OLD, SEQ_BEHAVIOR, SEQ_MASK, "seq_mask_tis", cap=1.8, low=0.5, high=1.6)
    torch.testing.assert_close(weights, torch.tensor([[1.8, 0.5], [0.0, 1.0], [1.5, 1.5]]))
    assert metrics["rollout_correction/masked_fraction"].item() == pytest.approx(1 / 5)
    assert metrics["rollout_correction/weight_mean"].item() == pytest.approx((1.8 + 0.5 + 1.5 + 1.5) / 5)
    # a lower end above row 0's mean of 1 masks it too: the band is two-sided
    weights, _ = rollout_correction(SEQ_OLD, SEQ_BEHAVIOR, SEQ_MASK, "seq_mask_tis", cap=1.8, low=1.2, high=1.6)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.5, 1.5]]))


def test_seq_mask_tis_leaves_a_masked_sequence_no_gradient_under_every_policy_loss():
    old, behavior, mask = (x.double() if x.is_floating_point() else x for x in (SEQ_OLD, SEQ_BEHAVIOR, SEQ_MASK))
    weights, _ = rollout_correction(old, behavior, mask, "seq_mask_tis", cap=1.8, low=0.5, high=1.4)
    advantages = torch.tensor([[1.0, 1.0], [-1.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    for name, loss_fn in POLICY_LOSSES.items():
        logprobs = (old + 0.01).requires_grad_()  # r = e^0.01: inside every clip range
        loss, _ = loss_fn(logprobs, old, advantages, mask, 0.2, 0.2, weights=weights)
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert torch.all(grad[1:] == 0), name  # rows 1 and 2 masked: exactly no gradient
        assert torch.all(grad[0] != 0), name


@pytest.mark.parametrize("mode", ["icepop", "seq_mask_tis"])
def test_banded_modes_ignore_padding_garbage_and_stay_finite(mode):
    old = torch.tensor([[-1.0, -2.0, 0.0, float("inf")], [0.0, 0.0, 0.0, 0.0]])
    behavior = torch.tensor([[-1.1, -1.9, -300.0, float("nan")], [-0.01, 0.0, 0.01, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    weights, metrics = rollout_correction(old, behavior, mask, mode, cap=2.0, low=0.5, high=5.0)
    assert torch.isfinite(weights).all() and weights[0, 3] == 1.0  # padding: weight 1
    assert all(torch.isfinite(v) for k, v in metrics.items() if k.startswith("rollout_correction/"))
    # row 0's third token has log rho = 300: icepop masks it alone, seq_mask_tis its whole sequence (mean 100)
    expected_row0 = [math.exp(0.1), math.exp(-0.1), 0.0] if mode == "icepop" else [0.0, 0.0, 0.0]
    torch.testing.assert_close(weights[0, :3], torch.tensor(expected_row0))
    torch.testing.assert_close(weights[1], torch.tensor([math.exp(0.01), 1.0, math.exp(-0.01), 1.0]))
