"""Policy loss, KL estimators and aggregation: hand-computed values, masking and micro-batching invariances."""

import math

import pytest
import torch
from torch.testing import assert_close

from learner.algo.losses import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    cispo_policy_loss,
    clipped_policy_loss,
    entropy_bonus,
    gspo_policy_loss,
    kl,
    micro_batch_weight,
    value_loss,
    vanilla_policy_loss,
)

F64 = torch.float64
GARBAGE = 1e4  # what padding may hold: large enough that exp() of it overflows, or 0 * it dominates a sum


def t(values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_match_hand_computed_values():
    # d = logp - ref = [1, -2]
    logprobs, ref_logprobs = t([0.0, -3.0]), t([-1.0, -1.0])
    assert_close(kl(logprobs, ref_logprobs, "k1"), t([1.0, -2.0]))  # d
    assert_close(kl(logprobs, ref_logprobs, "k2"), t([0.5, 2.0]))  # d^2 / 2
    # k3 = exp(-d) + d - 1: exp(-1) + 1 - 1 = e^-1;  exp(2) - 2 - 1 = e^2 - 3
    assert_close(kl(logprobs, ref_logprobs, "k3"), t([math.exp(-1), math.exp(2) - 3]))


def test_kl_estimators_are_zero_when_policies_agree():
    logprobs = t([-0.1, -2.5, -7.0])
    for name in KL_ESTIMATORS:
        assert_close(kl(logprobs, logprobs.clone(), name), torch.zeros(3, dtype=F64))


def test_kl_mask_zeroes_padding_value_and_gradient():
    logprobs = t([[-1.0, -GARBAGE]]).requires_grad_()
    ref_logprobs = t([[-2.0, GARBAGE]])  # exp(ref - logp) = exp(2e4) = inf without the mask
    mask = torch.tensor([[1, 0]])
    for name in KL_ESTIMATORS:
        values = kl(logprobs, ref_logprobs, name, mask=mask)
        assert_close(values[:, 1], t([0.0]))
        assert_close(values[:, 0], kl(t([-1.0]), t([-2.0]), name))
        (grad,) = torch.autograd.grad(values.sum(), logprobs)
        assert torch.isfinite(grad).all()
        assert grad[0, 1] == 0


def test_kl_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="k4"):
        kl(t([0.0]), t([0.0]), "k4")


def test_kl_registry_keys_are_the_config_names():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


# ---------------------------------------------------------------- aggregation

VALUES = [[1.0, 2.0, 3.0], [4.0, GARBAGE, -GARBAGE]]
MASK = [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4
        ("seq-mean-token-mean", 3.0),  # (6/3 + 4/1) / 2
        ("seq-mean-token-sum", 5.0),  # (6 + 4) / 2
        ("seq-mean-token-sum-norm", 1.25),  # (6 + 4) / (2 sequences * norm_length 4)
    ],
)
def test_aggregate_matches_hand_computed_values(mode, expected):
    assert_close(aggregate(t(VALUES), torch.tensor(MASK), mode, norm_length=4), t(expected))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4, the empty row adds no token
        ("seq-mean-token-mean", 3.0),  # (2 + 4) / 2: the empty row is not a sequence to average over
        ("seq-mean-token-sum", 10 / 3),  # (6 + 4 + 0) / 3: every row counts
        ("seq-mean-token-sum-norm", 10 / 12),  # 10 / (3 * 4)
    ],
)
def test_aggregate_with_an_empty_sequence(mode, expected):
    values = t([*VALUES, [9.0, 9.0, 9.0]])
    mask = torch.tensor([*MASK, [0, 0, 0]])
    assert_close(aggregate(values, mask, mode, norm_length=4), t(expected))


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_ignores_whatever_padding_holds(mode):
    mask = torch.tensor(MASK)
    reference = aggregate(t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]), mask, mode, norm_length=4)
    for fill in (GARBAGE, -GARBAGE, math.inf, math.nan):
        values = t([[1.0, 2.0, 3.0], [4.0, fill, fill]])
        assert_close(aggregate(values, mask, mode, norm_length=4), reference)
        assert_close(aggregate(values, mask.bool(), mode, norm_length=4), reference)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_of_no_tokens_is_zero_with_a_gradient_path(mode):
    values = t([[GARBAGE, 1.0], [2.0, 3.0]]).requires_grad_()
    result = aggregate(values, torch.zeros(2, 2), mode, norm_length=4)
    assert_close(result, t(0.0))
    (grad,) = torch.autograd.grad(result, values)
    assert_close(grad, torch.zeros(2, 2, dtype=F64))


def test_aggregate_norm_mode_requires_norm_length():
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(t(VALUES), torch.tensor(MASK), "seq-mean-token-sum-norm")


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token-median"):
        aggregate(t(VALUES), torch.tensor(MASK), "token-median")


def test_aggregation_modes_are_the_config_names():
    names = {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}
    assert set(AGGREGATION_MODES) == names


# ---------------------------------------------------------------- clipped policy loss

# Four response tokens, pi_old = 1 (old logprob 0), so ratio = exp(logprob). Clip range [0.8, 1.28].
#   t0: r=1.5, A=+1: max(-1.5, -1.28) = -1.28  clipped (upper bound 1 + clip_high, not 1 + clip_low)
#   t1: r=0.5, A=+1: max(-0.5, -0.80) = -0.50
#   t2: r=0.5, A=-1: max( 0.5,  0.80) =  0.80  clipped (lower bound 1 - clip_low)
#   t3: r=1.5, A=-1: max( 1.5,  1.28) =  1.50
# token-mean = (-1.28 - 0.5 + 0.8 + 1.5) / 4 = 0.13
RATIOS = [1.5, 0.5, 0.5, 1.5]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0]
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def _hand_inputs():
    logprobs = t([[math.log(r) for r in RATIOS]]).requires_grad_()
    return logprobs, torch.zeros(1, 4, dtype=F64), t([ADVANTAGES]), torch.ones(1, 4)


def test_clipped_policy_loss_matches_hand_computed_values():
    logprobs, old_logprobs, advantages, mask = _hand_inputs()
    loss, metrics = clipped_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP)
    assert_close(loss, t(0.13))
    # Clipped tokens (t0, t2) get no gradient; others d(-A r)/d logp / 4 = -A r / 4: t1 -0.5/4, t3 +1.5/4.
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, t([[0.0, -0.125, 0.0, 0.375]]))
    assert_close(metrics["clip_fraction"], t(0.5))  # t0 and t2
    assert_close(metrics["dual_clip_fraction"], t(0.0))
    assert_close(metrics["ratio_mean"], t(1.0))  # (1.5 + 0.5 + 0.5 + 1.5) / 4
    # k3 of KL(pi_old || pi) = (r - 1) - log r, averaged over the four tokens
    k3 = [(r - 1) - math.log(r) for r in RATIOS]
    assert_close(metrics["approx_kl"], t(sum(k3) / 4))


def test_ratios_inside_the_clip_range_are_not_counted_as_clipped():
    # r=1.1, A=+1: -1.1 vs -1.1 (equal);  r=0.9, A=-1: 0.9 vs 0.9;  only r=2, A=+1 (-2 vs -1.28) is clipped.
    logprobs = t([[math.log(1.1), math.log(0.9), math.log(2.0)]])
    advantages = t([[1.0, -1.0, 1.0]])
    _, metrics = clipped_policy_loss(logprobs, torch.zeros(1, 3, dtype=F64), advantages, torch.ones(1, 3), **CLIP)
    assert_close(metrics["clip_fraction"], t(1 / 3))


def test_clipped_policy_loss_metrics_are_detached_scalars():
    _, metrics = clipped_policy_loss(*_hand_inputs(), **CLIP)
    assert set(metrics) == {"clip_fraction", "dual_clip_fraction", "ratio_mean", "approx_kl"}
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad


def test_clipped_policy_loss_uses_the_requested_aggregation():
    # Row 0 losses: [-1.28, -0.5] (t0, t1), row 1: [0.8] (t2); seq-mean-token-mean = (-0.89 + 0.8) / 2
    logprobs = t([[math.log(1.5), math.log(0.5)], [math.log(0.5), 0.0]])
    advantages = t([[1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    old_logprobs = torch.zeros(2, 2, dtype=F64)
    loss, _ = clipped_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP, mode="seq-mean-token-mean")
    assert_close(loss, t((-1.78 / 2 + 0.8) / 2))


def test_dual_clip_bounds_the_loss_of_negative_advantages_only():
    # c = 3. A=-1: r=5 -> max(5, 1.28) = 5 -> min(5, 3) = 3 (dual clip);  r=2 -> 2 < 3 untouched.
    #        A=+1: r=0.1 -> max(-0.1, -0.8) = -0.1; applying min(., -A c = -3) there would wrongly give -3.
    logprobs = t([[math.log(5.0), math.log(2.0), math.log(0.1)]]).requires_grad_()
    advantages = t([[-1.0, -1.0, 1.0]])
    old_logprobs, mask = torch.zeros(1, 3, dtype=F64), torch.ones(1, 3)
    loss, metrics = clipped_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP, clip_c=3.0)
    assert_close(loss, t((3.0 + 2.0 - 0.1) / 3))
    assert_close(metrics["dual_clip_fraction"], t(1 / 3))
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, t([[0.0, 2.0 / 3, -0.1 / 3]]))  # the dual-clipped token gets no gradient

    positive = t([[1.0, 0.5, 1.0]])
    with_dual, _ = clipped_policy_loss(logprobs, old_logprobs, positive, mask, **CLIP, clip_c=3.0)
    without_dual, _ = clipped_policy_loss(logprobs, old_logprobs, positive, mask, **CLIP)
    assert_close(with_dual, without_dual)


@pytest.mark.parametrize("clip_c", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(clip_c):
    with pytest.raises(ValueError, match="clip_c"):
        clipped_policy_loss(*_hand_inputs(), **CLIP, clip_c=clip_c)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_padding_changes_neither_loss_nor_metrics_nor_gradient(mode):
    logprobs, old_logprobs, advantages, mask = _hand_inputs()
    args = {**CLIP, "clip_c": 3.0, "mode": mode, "norm_length": 6}
    loss, metrics = clipped_policy_loss(logprobs, old_logprobs, advantages, mask, **args)
    (grad,) = torch.autograd.grad(loss, logprobs)

    # Same four tokens followed by two padding positions full of garbage (exp(2e4) overflows if not masked).
    padded_logprobs = torch.cat([logprobs.detach(), t([[GARBAGE, -GARBAGE]])], dim=1).requires_grad_()
    padded_old = torch.cat([old_logprobs, t([[-GARBAGE, GARBAGE]])], dim=1)
    padded_advantages = torch.cat([advantages, t([[-GARBAGE, GARBAGE]])], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(1, 2)], dim=1)
    padded_inputs = (padded_logprobs, padded_old, padded_advantages, padded_mask)
    padded_loss, padded_metrics = clipped_policy_loss(*padded_inputs, **args)
    (padded_grad,) = torch.autograd.grad(padded_loss, padded_logprobs)

    assert_close(padded_loss, loss)
    assert_close(padded_metrics, metrics)
    assert_close(padded_grad, torch.cat([grad, torch.zeros(1, 2, dtype=F64)], dim=1))


def test_micro_batches_weighted_by_token_share_give_the_whole_batch_gradient():
    generator = torch.Generator().manual_seed(0)
    batch, length = 5, 7
    logprobs = (-torch.rand(batch, length, generator=generator, dtype=F64) * 3).requires_grad_()
    old_logprobs = logprobs.detach() + 0.3 * torch.randn(batch, length, generator=generator, dtype=F64)
    advantages = torch.randn(batch, length, generator=generator, dtype=F64)
    lengths = torch.tensor([7, 2, 5, 1, 4])  # unequal, so token share differs from sequence share
    mask = (torch.arange(length) < lengths[:, None]).to(F64)
    args = {"clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0, "mode": "token-mean"}

    whole_loss, whole_metrics = clipped_policy_loss(logprobs, old_logprobs, advantages, mask, **args)
    (whole_grad,) = torch.autograd.grad(whole_loss, logprobs)
    assert whole_metrics["clip_fraction"] > 0  # the clipped branch is exercised, not only the plain ratio

    total_tokens = mask.sum()
    accumulated = torch.zeros_like(logprobs)
    for rows in (slice(0, 2), slice(2, 5)):  # 9 and 10 tokens
        mb_loss, _ = clipped_policy_loss(logprobs[rows], old_logprobs[rows], advantages[rows], mask[rows], **args)
        (mb_grad,) = torch.autograd.grad(mb_loss * mask[rows].sum() / total_tokens, logprobs)
        accumulated += mb_grad
    assert_close(accumulated, whole_grad)

    # Without the token-share weights (plain mean of micro-batch losses) the gradient differs: the test can fail.
    unweighted = torch.zeros_like(logprobs)
    for rows in (slice(0, 2), slice(2, 5)):
        mb_loss, _ = clipped_policy_loss(logprobs[rows], old_logprobs[rows], advantages[rows], mask[rows], **args)
        unweighted += torch.autograd.grad(mb_loss / 2, logprobs)[0]
    assert not torch.allclose(unweighted, whole_grad)


# ---------------------------------------------------------------- GSPO


def test_gspo_with_identical_logprobs_is_minus_the_mean_sequence_advantage():
    # s_i = 1 for every sequence, nothing clipped: loss = -(2 - 1 + 0.5) / 3 = -0.5.
    # Row 3 has no response token: it is not a sequence to average over, whatever its advantages hold.
    logprobs = t([[-1.0, -2.0, -0.5], [-0.3, GARBAGE, GARBAGE], [-4.0, -0.1, 0.0], [GARBAGE, 1.0, 2.0]])
    advantages = t([[2.0, 2.0, 2.0], [-1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [GARBAGE, GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    loss, metrics = gspo_policy_loss(logprobs, logprobs.clone(), advantages, mask, **CLIP)
    assert_close(loss, t(-0.5))
    assert_close(metrics["clip_fraction"], t(0.0))
    assert_close(metrics["ratio_mean"], t(1.0))
    assert_close(metrics["seq_clip_fraction"], t(0.0))
    assert_close(metrics["seq_ratio_mean"], t(1.0))


def _gspo_hand_inputs():
    # old logprobs 0, so the per-token log-ratios are the logprobs. Clip range [0.8, 1.28].
    #   row 0: log-ratios [0.2, 0.6], mean 0.4, s = e^0.4 = 1.4918, A=+1: max(-1.4918, -1.28) = -1.28  clipped
    #   row 1: log-ratio [-1.0], s = e^-1 = 0.3679, A=-1: max(0.3679, 0.8) = 0.8                      clipped
    #   row 2: log-ratios [0.1, -0.1, 0.0], mean 0, s = 1, A=+2: max(-2, -2) = -2
    # loss = (-1.28 + 0.8 - 2) / 3 = -2.48 / 3. Per token, row 0's second token (r = e^0.6 = 1.82) would differ.
    logprobs = t([[0.2, 0.6, 0.0], [-1.0, 0.0, 0.0], [0.1, -0.1, 0.0]]).requires_grad_()
    advantages = t([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    return logprobs, torch.zeros(3, 3, dtype=F64), advantages, mask


def test_gspo_matches_hand_computed_values():
    logprobs, old_logprobs, advantages, mask = _gspo_hand_inputs()
    loss, metrics = gspo_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP)
    assert_close(loss, t(-2.48 / 3))
    # Per sequence: rows 0 and 1 of 3 clipped; s = [e^0.4, e^-1, 1].
    assert_close(metrics["seq_clip_fraction"], t(2 / 3))
    assert_close(metrics["seq_ratio_mean"], t((math.exp(0.4) + math.exp(-1.0) + 1.0) / 3))
    # Per token, as clipped_policy_loss's keys mean: the 2 + 1 tokens of rows 0 and 1 of 6 tokens are clipped;
    # log-ratios x = [0.2, 0.6 | -1.0 | 0.1, -0.1, 0.0], r_t = e^x, k3 = (r_t - 1) - log r_t = e^x - 1 - x.
    token_log_ratios = (0.2, 0.6, -1.0, 0.1, -0.1, 0.0)
    assert_close(metrics["clip_fraction"], t(3 / 6))
    assert_close(metrics["ratio_mean"], t(sum(math.exp(x) for x in token_log_ratios) / 6))
    assert_close(metrics["dual_clip_fraction"], t(0.0))
    assert_close(metrics["approx_kl"], t(sum(math.exp(x) - 1 - x for x in token_log_ratios) / 6))
    assert set(metrics) == {"clip_fraction", "dual_clip_fraction", "ratio_mean", "approx_kl", "seq_clip_fraction",
                            "seq_ratio_mean"}
    assert all(value.dim() == 0 and not value.requires_grad for value in metrics.values())
    # Clipped rows get no gradient; row 2: d(-A s)/d logp_t / 3 sequences = -2 * 1 * (1/3 tokens) / 3 = -2/9.
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-2 / 9, -2 / 9, -2 / 9]]))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # l = [-1.28, 0.8, -2] on rows of 2, 1, 3 tokens (see _gspo_hand_inputs); token sum 2*-1.28 + 0.8 + 3*-2 = -7.76
        ("seq-mean-token-mean", -2.48 / 3),  # (-1.28 + 0.8 - 2) / 3 sequences: the paper's mean over sequences
        ("token-mean", -7.76 / 6),  # -7.76 / 6 tokens = -1.2933, not -0.8267: long row 2 weighs 3 times
        ("seq-mean-token-sum", -7.76 / 3),  # -7.76 / 3 rows
        ("seq-mean-token-sum-norm", -7.76 / 12),  # -7.76 / (3 rows * norm_length 4)
    ],
)
def test_gspo_reduces_the_sequence_loss_on_each_token_with_the_requested_mode(mode, expected):
    logprobs, old_logprobs, advantages, mask = _gspo_hand_inputs()
    loss, _ = gspo_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP, mode=mode, norm_length=4)
    assert_close(loss, t(expected))


def test_gspo_token_mean_gradient_weighs_each_sequence_by_its_length():
    # Row 2 (3 tokens, not clipped): loss = (... + 3 * -A s) / 6, ds/dlogp_t = s / 3 = 1/3,
    #   so d loss / d logp_t = 3 * -2 * (1/3) / 6 = -1/3 per token (the sequence mean gives -2/9).
    logprobs, old_logprobs, advantages, mask = _gspo_hand_inputs()
    loss, _ = gspo_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP, mode="token-mean")
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1 / 3, -1 / 3, -1 / 3]]))


def test_gspo_rejects_the_dual_clip():
    with pytest.raises(ValueError, match="dual clip is not defined for gspo; unset clip_c"):
        gspo_policy_loss(*_gspo_hand_inputs(), **CLIP, clip_c=3.0)


def test_policy_loss_registry_keys_are_the_config_names_and_share_metric_keys():
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "vanilla", "cispo"}
    assert POLICY_LOSSES["ppo"] is clipped_policy_loss and POLICY_LOSSES["gspo"] is gspo_policy_loss
    assert POLICY_LOSSES["vanilla"] is vanilla_policy_loss and POLICY_LOSSES["cispo"] is cispo_policy_loss
    inputs = _gspo_hand_inputs()
    ppo, gspo, vanilla, cispo = (set(POLICY_LOSSES[name](*inputs, **CLIP, mode="token-mean")[1])
                                 for name in ("ppo", "gspo", "vanilla", "cispo"))
    assert ppo == vanilla == cispo == {"clip_fraction", "dual_clip_fraction", "ratio_mean", "approx_kl"}
    assert gspo == ppo | {"seq_clip_fraction", "seq_ratio_mean"}  # the sequence-level ratio shows in its own keys


def test_gspo_padding_changes_neither_loss_nor_metrics_nor_gradient():
    logprobs, old_logprobs, advantages, mask = _gspo_hand_inputs()
    loss, metrics = gspo_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP)
    (grad,) = torch.autograd.grad(loss, logprobs)

    padding = ~mask.bool()
    garbage_logprobs = logprobs.detach().masked_fill(padding, GARBAGE).requires_grad_()
    garbage_old = old_logprobs.masked_fill(padding, -GARBAGE)
    garbage_advantages = advantages.masked_fill(padding, -GARBAGE)
    garbage_loss, garbage_metrics = gspo_policy_loss(garbage_logprobs, garbage_old, garbage_advantages, mask, **CLIP)
    (garbage_grad,) = torch.autograd.grad(garbage_loss, garbage_logprobs)

    assert_close(garbage_loss, loss)
    assert_close(garbage_metrics, metrics)
    assert_close(garbage_grad, grad)


# ---------------------------------------------------------------- value loss

# clip = 0.2, one sequence of three tokens:
#   t0: V=1.0, V_old=0.5, R=1.0: V_c = 0.7; max(0^2, 0.3^2) = 0.09 -> l = 0.045   clipped term larger
#   t1: V=0.6, V_old=0.5, R=0.0: V_c = 0.6 (inside); max(0.36, 0.36) -> l = 0.18
#   t2: V=0.0, V_old=0.5, R=1.0: V_c = 0.3; max(1.0, 0.49) = 1.0 -> l = 0.5
# token-mean = (0.045 + 0.18 + 0.5) / 3 = 0.725 / 3; token sum = 0.725.
def _value_hand_inputs():
    values = t([[1.0, 0.6, 0.0]]).requires_grad_()
    return values, t([[0.5, 0.5, 0.5]]), t([[1.0, 0.0, 1.0]]), torch.ones(1, 3)


def test_value_loss_matches_hand_computed_values_with_the_clip_active():
    values, old_values, returns, mask = _value_hand_inputs()
    loss, metrics = value_loss(values, old_values, returns, mask, clip=0.2)
    assert_close(loss, t(0.725 / 3))
    assert_close(metrics["clip_fraction"], t(1 / 3))
    assert set(metrics) == {"clip_fraction"} and not metrics["clip_fraction"].requires_grad
    # t0: the clipped term is taken and clamp() passes no gradient; t1: (V - R) / 3 = 0.2; t2: (0 - 1) / 3.
    (grad,) = torch.autograd.grad(loss, values)
    assert_close(grad, t([[0.0, 0.2, -1 / 3]]))
    summed, _ = value_loss(values, old_values, returns, mask, clip=0.2, mode="seq-mean-token-sum")
    assert_close(summed, t(0.725))


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_value_loss_padding_changes_neither_loss_nor_metrics_nor_gradient(mode):
    values, old_values, returns, mask = _value_hand_inputs()
    loss, metrics = value_loss(values, old_values, returns, mask, 0.2, mode, norm_length=5)
    (grad,) = torch.autograd.grad(loss, values)

    padded_values = torch.cat([values.detach(), t([[GARBAGE, math.nan]])], dim=1).requires_grad_()
    padded_old = torch.cat([old_values, t([[-GARBAGE, math.inf]])], dim=1)
    padded_returns = torch.cat([returns, t([[math.inf, -GARBAGE]])], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(1, 2)], dim=1)
    padded_loss, padded_metrics = value_loss(padded_values, padded_old, padded_returns, padded_mask, 0.2, mode, 5)
    (padded_grad,) = torch.autograd.grad(padded_loss, padded_values)

    assert_close(padded_loss, loss)
    assert_close(padded_metrics, metrics)
    assert_close(padded_grad, torch.cat([grad, torch.zeros(1, 2, dtype=F64)], dim=1))


# ---------------------------------------------------------------- entropy bonus


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.0),  # (1 + 2 + 3) / 3
        ("seq-mean-token-mean", 2.25),  # (1.5 + 3) / 2
    ],
)
def test_entropy_bonus_aggregates_response_tokens_only(mode, expected):
    entropy = t([[1.0, 2.0, GARBAGE], [3.0, math.nan, GARBAGE]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(entropy_bonus(entropy, mask, mode), t(expected))


# ---------------------------------------------------------------- micro-batch weights


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # part: rows of 2 and 0 tokens (trimmed to 2 columns); whole: rows of 2, 0, 3, 1 tokens (4 columns).
        ("token-mean", 2 / 6),  # 2 tokens of 6
        ("seq-mean-token-mean", 1 / 3),  # 1 non-empty sequence of 3
        ("seq-mean-token-sum", 2 / 4),  # 2 rows of 4
        ("seq-mean-token-sum-norm", 2 / 4),
    ],
)
def test_micro_batch_weight_matches_hand_computed_shares(mode, expected):
    whole = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    part = whole[:2, :2]
    assert micro_batch_weight(part, whole, mode) == pytest.approx(expected, rel=1e-15)
    assert micro_batch_weight(part.bool(), whole.bool(), mode) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_weight_is_zero_when_the_whole_has_no_response_token(mode):
    assert micro_batch_weight(torch.zeros(1, 3), torch.zeros(2, 3), mode) == 0.0


def test_micro_batch_weight_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token-median"):
        micro_batch_weight(torch.ones(1, 2), torch.ones(2, 2), "token-median")


MICRO_BATCH_ROWS = (slice(0, 1), slice(1, 3), slice(3, 6))  # uneven: 1, 2 and 3 rows


def _micro_batch_case(loss_name, mode):
    """A ragged batch of 6 rows (one empty) and a loss call whose first argument carries the gradient."""
    generator = torch.Generator().manual_seed(3)
    batch, length = 6, 7
    lengths = torch.tensor([7, 2, 0, 5, 1, 4])  # unequal, so token, sequence and row shares all differ
    mask = (torch.arange(length) < lengths[:, None]).to(F64)
    leaf = (-torch.rand(batch, length, generator=generator, dtype=F64) * 3).requires_grad_()
    old = leaf.detach() + 0.3 * torch.randn(batch, length, generator=generator, dtype=F64)
    if loss_name == "value":
        returns = torch.randn(batch, length, generator=generator, dtype=F64)
        others = (old, returns)

        def call(*args):
            return value_loss(*args, clip=0.2, mode=mode, norm_length=length)[0]

    else:
        if loss_name == "gspo":  # one advantage per sequence, as GSPO expects
            advantages = torch.randn(batch, 1, generator=generator, dtype=F64).expand(batch, length)
        else:
            advantages = torch.randn(batch, length, generator=generator, dtype=F64)
        others = (old, advantages)
        clip_c = 3.0 if loss_name == "ppo" else None  # cispo: the weights' clip bites (old is 0.3 away)

        def call(*args):
            return POLICY_LOSSES[loss_name](
                *args, clip_low=0.2, clip_high=0.28, clip_c=clip_c, mode=mode, norm_length=length
            )[0]

    return leaf, others, mask, lengths, call


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo", "value"])
def test_micro_batches_weighted_by_micro_batch_weight_give_the_whole_batch_gradient(loss_name, mode):
    leaf, others, mask, lengths, call = _micro_batch_case(loss_name, mode)
    (whole_grad,) = torch.autograd.grad(call(leaf, *others, mask), leaf)
    assert whole_grad.abs().sum() > 0

    weighted, unweighted = torch.zeros_like(leaf), torch.zeros_like(leaf)
    for rows in MICRO_BATCH_ROWS:
        width = max(int(lengths[rows].max()), 1)  # each micro-batch trimmed to its own longest response
        mb_mask = mask[rows, :width]
        mb_loss = call(leaf[rows, :width], *(x[rows, :width] for x in others), mb_mask)
        weight = micro_batch_weight(mb_mask, mask, mode)
        weighted += torch.autograd.grad(mb_loss * weight, leaf, retain_graph=True)[0]
        unweighted += torch.autograd.grad(mb_loss / len(MICRO_BATCH_ROWS), leaf)[0]
    assert_close(weighted, whole_grad)
    # A plain mean of the micro-batch losses weighs the 1-row batch like the 3-row one: the test can fail.
    assert not torch.allclose(unweighted, whole_grad)


# ---------------------------------------------------------------- decoupled PPO (asynchronous training)


def test_decoupled_ppo_takes_the_ratio_against_the_proximal_policy_and_weighs_by_the_capped_behaviour_ratio():
    """Hilton et al. 2022: r_t = pi / pi_prox (clipped as PPO's), each term weighed by w_t = min(pi_prox / pi_behav,
    C), the rollout correction's `tis` weight. Four tokens sampled by a stale engine; C = 2."""
    from learner.algo.correction import rollout_correction

    logprobs, proximal, advantages, mask = _hand_inputs()  # r = 1.5, 0.5, 0.5, 1.5 against pi_prox; A = 1, 1, -1, -1
    # pi_prox / pi_behav = 2, .25, 1, 1.25
    behaviour = t([[math.log(0.5), math.log(4.0), math.log(1.0), math.log(0.8)]])
    weights, metrics = rollout_correction(proximal, behaviour, mask, "tis", cap=2.0)
    assert_close(weights, t([[2.0, 0.25, 1.0, 1.25]]))
    assert float(metrics["rollout_correction/capped_fraction"]) == 0.0  # 2 is at the cap, not above
    loss, _ = clipped_policy_loss(logprobs, proximal, advantages, mask, **CLIP, weights=weights)
    # PPO's per-token losses at these ratios (CLIP: 0.2 / 0.28): -1.28, -0.5, 0.8, 1.5; weighed: -2.56, -0.125, 0.8,
    # 1.875; token mean 0.0025 (the unweighed loss is 0.13, test above).
    assert_close(loss, t((-2.56 - 0.125 + 0.8 + 1.875) / 4))
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, t([[0.0, -0.5 * 0.25 / 4, 0.0, 1.5 * 1.25 / 4]]))  # clipped tokens still get none
    # In step with the engine (k = 0, no numerics gap) every weight is 1 and the loss is PPO's exactly.
    same, _ = rollout_correction(proximal, proximal, mask, "tis", cap=2.0)
    assert torch.equal(same, torch.ones_like(same))
    assert torch.equal(clipped_policy_loss(logprobs, proximal, advantages, mask, **CLIP, weights=same)[0],
                       clipped_policy_loss(logprobs, proximal, advantages, mask, **CLIP)[0])


def test_vanilla_loss_is_minus_advantage_times_logprob_with_no_ratio_or_clip():
    # l = -A log pi: token 0: -(2)(-1) = 2, token 1: -(-1)(-2) = -2; token-mean 0. Gradient wrt log pi: -A / 2.
    # The policy moved far from pi_old (ratios e^1 and e^-1, outside any clip range): nothing is clipped.
    logprobs = torch.tensor([[-1.0, -2.0, GARBAGE]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-2.0, -1.0, -GARBAGE]], dtype=F64)
    advantages = torch.tensor([[2.0, -1.0, GARBAGE]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = vanilla_policy_loss(logprobs, old, advantages, mask, **CLIP)
    assert_close(loss, torch.tensor(0.0, dtype=F64))
    loss.backward()
    assert_close(logprobs.grad, torch.tensor([[-1.0, 0.5, 0.0]], dtype=F64))
    assert float(metrics["clip_fraction"]) == 0 and float(metrics["dual_clip_fraction"]) == 0
    assert_close(metrics["ratio_mean"], torch.tensor((math.e + 1 / math.e) / 2, dtype=F64))
    # Per-token weights (the rollout correction) scale each term: (0.5 * 2 + 1 * -2) / 2 = -0.5.
    weighted, _ = vanilla_policy_loss(logprobs.detach(), old, advantages, mask, **CLIP,
                                      weights=torch.tensor([[0.5, 1.0, 7.0]], dtype=F64))
    assert_close(weighted, torch.tensor(-0.5, dtype=F64))
    # seq-mean-token-sum: the one sequence's sum, 0.
    assert_close(vanilla_policy_loss(logprobs.detach(), old, advantages, mask, **CLIP, mode="seq-mean-token-sum")[0],
                 torch.tensor(0.0, dtype=F64))
    with pytest.raises(ValueError, match="dual clip"):
        vanilla_policy_loss(logprobs, old, advantages, mask, **CLIP, clip_c=3.0)


def test_vanilla_loss_has_the_ppo_gradient_at_ratio_one():
    """With one update per batch (pi = pi_old) REINFORCE's gradient is PPO's: grad r_t = grad log pi at r_t = 1."""
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=gen, dtype=F64)
    advantages = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    grads = []
    for loss_fn in (vanilla_policy_loss, clipped_policy_loss):
        lp = logprobs.clone().requires_grad_(True)
        loss_fn(lp, logprobs, advantages, mask, **CLIP)[0].backward()
        grads.append(lp.grad)
    assert_close(grads[0], grads[1])


# ---------------------------------------------------------------- CISPO

# Three tokens, pi_old = 1 (old logprob 0), so log pi = log r. Weights c = clip(r, 0.8, 1.28):
#   t0: r=2.0, A=+1: c = 1.28 (clipped), l = -1.28 * 1 * ln 2
#   t1: r=0.5, A=-1: c = 0.80 (clipped), l = -0.80 * -1 * ln 0.5 = -0.8 ln 2
#   t2: r=1.1, A=+2: c = 1.10,           l = -1.10 * 2 * ln 1.1
# token-mean = (-2.08 ln 2 - 2.2 ln 1.1) / 3; d l_t / d log pi_t = -c_t A_t / 3 (c is a constant): none is 0.
CISPO_RATIOS = [2.0, 0.5, 1.1]


def _cispo_hand_inputs():
    logprobs = t([[math.log(r) for r in CISPO_RATIOS]]).requires_grad_()
    return logprobs, torch.zeros(1, 3, dtype=F64), t([[1.0, -1.0, 2.0]]), torch.ones(1, 3)


def test_cispo_matches_hand_computed_values_and_keeps_every_tokens_gradient():
    logprobs, old_logprobs, advantages, mask = _cispo_hand_inputs()
    loss, metrics = cispo_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP)
    assert_close(loss, t((-2.08 * math.log(2) - 2.2 * math.log(1.1)) / 3))
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, t([[-1.28 / 3, 0.8 / 3, -2.2 / 3]]))
    assert_close(metrics["clip_fraction"], t(2 / 3))  # t0 and t1: their weights were clipped, not their gradients
    assert_close(metrics["ratio_mean"], t((2.0 + 0.5 + 1.1) / 3))
    assert_close(metrics["approx_kl"], t(sum((r - 1) - math.log(r) for r in CISPO_RATIOS) / 3))
    assert float(metrics["dual_clip_fraction"]) == 0
    # PPO drops t0 (r = 2 > 1.28 with A > 0) and t1 (r = 0.5 < 0.8 with A < 0): the difference CISPO makes
    (ppo_grad,) = torch.autograd.grad(clipped_policy_loss(logprobs, old_logprobs, advantages, mask, **CLIP)[0],
                                      logprobs)
    assert ppo_grad[0, 0] == 0 and ppo_grad[0, 1] == 0 and grad[0, 0] != 0 and grad[0, 1] != 0
    # CISPO's own range, [0, 4] (clip_low 1, clip_high 3): nothing clipped, each weight is r_t
    loss, metrics = cispo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=1.0, clip_high=3.0)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, t([[-2.0 / 3, 0.5 / 3, -2.2 / 3]]))
    assert float(metrics["clip_fraction"]) == 0


def test_cispo_has_the_reinforce_gradient_at_ratio_one_and_weighs_each_term():
    gen = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(3, 5, generator=gen, dtype=F64)
    advantages = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    weights = torch.rand(3, 5, generator=gen, dtype=F64)
    grads = []
    for loss_fn in (vanilla_policy_loss, cispo_policy_loss):
        lp = logprobs.clone().requires_grad_(True)
        loss_fn(lp, logprobs, advantages, mask, **CLIP, weights=weights)[0].backward()
        grads.append(lp.grad)
    assert grads[0].abs().sum() > 0
    assert_close(grads[1], grads[0])
    with pytest.raises(ValueError, match="dual clip is not defined for cispo"):
        cispo_policy_loss(logprobs, logprobs, advantages, mask, **CLIP, clip_c=3.0)


def test_cispo_padding_changes_neither_loss_nor_metrics_nor_gradient():
    logprobs = t([[-1.0, -2.0, 0.0]]).requires_grad_()
    old, advantages, mask = t([[-1.5, -1.0, 0.0]]), t([[1.0, -1.0, 0.0]]), torch.tensor([[1, 1, 0]])
    loss, metrics = cispo_policy_loss(logprobs, old, advantages, mask, **CLIP)
    (grad,) = torch.autograd.grad(loss, logprobs)
    garbage = logprobs.detach().masked_fill(~mask.bool(), GARBAGE).requires_grad_()
    garbage_loss, garbage_metrics = cispo_policy_loss(garbage, old.masked_fill(~mask.bool(), -GARBAGE),
                                                      advantages.masked_fill(~mask.bool(), GARBAGE), mask, **CLIP)
    (garbage_grad,) = torch.autograd.grad(garbage_loss, garbage)
    assert_close(garbage_loss, loss)
    assert_close(garbage_metrics, metrics)
    assert_close(garbage_grad, grad)
    assert garbage_grad[0, 2] == 0


def test_cispo_defaults_to_its_one_sided_clip_range_unless_told_otherwise():
    from learner.config import LearnerConfig

    cispo = LearnerConfig(policy_loss="cispo")
    assert (cispo.clip_low, cispo.clip_high) == (1.0, 3.0)  # weights in [0, 4]
    assert LearnerConfig(policy_loss="cispo", clip_high=0.28).clip_high == 0.28
    assert (LearnerConfig().clip_low, LearnerConfig().clip_high) == (0.2, 0.2)  # PPO's range for the others
