"""On-policy distillation's advantage (learner/algo/advantages.py) against hand-computed values: the per-token
log-ratio, its discounted sum, and how the model tokens of multi-turn episodes carry it."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from learner.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    distill_advantages,
    distill_log_ratios,
    on_model_tokens,
)

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -1.0, -0.2], [-2.0, -0.1, 99.0]])  # padding holds garbage
STUDENT = torch.tensor([[-1.5, -0.5, -0.2], [-0.5, -0.6, -99.0]])
# d = teacher - student at masked tokens: [[1.0, -0.5, 0.0], [-1.5, 0.5, 0]]
RATIOS = torch.tensor([[1.0, -0.5, 0.0], [-1.5, 0.5, 0.0]])


def inputs(distill, mask=MASK, discount=0.0):
    return AdvantageInputs(token_rewards=torch.zeros_like(mask), mask=mask, group_size=1, distill=distill,
                           distill_discount=discount)


def test_log_ratios_are_teacher_minus_student_at_masked_tokens():
    assert_close(distill_log_ratios(TEACHER, STUDENT, MASK), RATIOS)


def test_log_ratios_are_minus_the_k1_reverse_kl_estimate():
    # Sampled from the student: E[log pi - log pi_T] = KL(pi || pi_T). Two tokens, pi = (0.75, 0.25),
    # pi_T = (0.5, 0.5): KL = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.130812..., the mean of -d weighted by pi.
    student, teacher = torch.tensor([[0.75, 0.25]]).log(), torch.tensor([[0.5, 0.5]]).log()
    d = distill_log_ratios(teacher, student, torch.ones(1, 2))
    assert float(-(d * torch.tensor([[0.75, 0.25]])).sum()) == pytest.approx(0.130812, abs=1e-6)


def test_undiscounted_advantage_is_each_tokens_own_log_ratio():
    result = ADVANTAGE_ESTIMATORS["distill"](inputs(RATIOS))
    assert result.returns is None
    assert_close(result.advantages, RATIOS)


def test_discounted_advantage_sums_the_rest_of_the_sequence():
    # gamma 0.5: row 0: A_2 = 0, A_1 = -0.5 + 0.5 * 0 = -0.5, A_0 = 1 + 0.5 * -0.5 = 0.75;
    # row 1: A_1 = 0.5, A_0 = -1.5 + 0.25 = -1.25, padding 0.
    result = distill_advantages(inputs(RATIOS, discount=0.5))
    assert_close(result.advantages, torch.tensor([[0.75, -0.5, 0.0], [-1.25, 0.5, 0.0]]))
    # gamma 1: the sum of the rest: row 0: 0.5, -0.5, 0; row 1: -1.0, 0.5.
    assert_close(distill_advantages(inputs(RATIOS, discount=1.0)).advantages,
                 torch.tensor([[0.5, -0.5, 0.0], [-1.0, 0.5, 0.0]]))


def test_environment_tokens_are_skipped_by_the_discount():
    # Row: model, env, model: compacted, the two model tokens are neighbours: A_0 = 1 + 0.5 * 2 = 2, A_2 = 2.
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    ratios = torch.tensor([[1.0, 0.0, 2.0]])
    result = on_model_tokens(distill_advantages, inputs(ratios, mask=mask, discount=0.5))
    assert_close(result.advantages, torch.tensor([[2.0, 0.0, 2.0]]))


def test_without_the_teachers_ratios_the_estimator_says_what_to_set():
    with pytest.raises(ValueError, match="teacher.path and learner.distill_coef"):
        distill_advantages(inputs(None))
