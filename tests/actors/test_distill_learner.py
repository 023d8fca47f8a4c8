"""On-policy distillation in the learner, in-process, float32 and bfloat16: a teacher (a ReferenceWorker on another,
larger model with the same tokenizer) scores the response tokens, and the learner's update moves the policy
towards it; the teacher's advantage adds to the rewards' exactly; `distill/reverse_kl` is the mean of
log pi - log pi_teacher."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.reference import ReferenceWorker
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.learner import Learner

PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 12, 4, 15]] * 2  # "37+45=" x2, "1+2=" x2 (char ids)
RESPONSES = [[12, 2, 1], [4, 4, 1], [5, 1], [9, 1]]
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another size than the student's (hidden 128, 4 heads), the same character tokenizer."""
    from cluster.demo.model import make_random_model_dir

    return make_random_model_dir(tmp_path_factory.mktemp("models") / "teacher", seed=7, hidden_size=128, num_heads=4,
                                 num_kv_heads=2)


def make_learner(model_dir, dtype: str, **overrides) -> Learner:
    config = LearnerConfig(**{"lr": 1e-2, "kl_coef": 0.0, "num_threads": 2, "advantage": "distill",
                              "distill_coef": 1.0, **overrides})
    return Learner(str(model_dir), config, dtype=dtype, seed=0, norm_length=4)


def teacher_logprobs(model_dir, dtype: str) -> np.ndarray:
    count, flat = ReferenceWorker(str(model_dir), dtype=dtype, num_threads=2).compute_flat_logprobs(PROMPTS, RESPONSES)
    assert count == sum(map(len, RESPONSES))
    return flat


def batch(learner: Learner, rewards=(0.0, 0.0, 0.0, 0.0)) -> TrainBatch:
    return TrainBatch(PROMPTS, RESPONSES, learner.compute_logprobs(PROMPTS, RESPONSES), list(rewards), 2)


def gap(learner: Learner, teacher: np.ndarray) -> float:
    """Mean |log pi - log pi_teacher| over the response tokens."""
    mine = np.concatenate(learner.compute_logprobs(PROMPTS, RESPONSES))
    return float(np.abs(mine - teacher).mean())


@pytest.mark.parametrize("dtype", DTYPES)
def test_updates_move_the_policy_towards_the_teacher(tiny_model_dir, teacher_dir, dtype):
    learner = make_learner(tiny_model_dir, dtype)
    teacher = teacher_logprobs(teacher_dir, dtype)
    before = np.concatenate(learner.compute_logprobs(PROMPTS, RESPONSES))
    metrics = learner.train_step(batch(learner), teacher_logprobs=teacher)
    # The metric is the token mean of log pi - log pi_teacher, pi the policy before the update.
    assert metrics["distill/reverse_kl"] == pytest.approx(float((before - teacher).mean()), abs=1e-3 if dtype ==
                                                          "bfloat16" else 1e-5)
    gaps = [float(np.abs(before - teacher).mean())]
    for _ in range(5):
        learner.train_step(batch(learner), teacher_logprobs=teacher)
        gaps.append(gap(learner, teacher))
    assert gaps[-1] < 0.5 * gaps[0], f"the policy did not move towards the teacher: {gaps}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_teachers_advantage_adds_to_the_rewards(tiny_model_dir, teacher_dir, dtype):
    """With equal rewards (GRPO advantage 0), GRPO plus the teacher's advantage updates exactly as distillation alone;
    with rewards, it does not (the rewards' advantage is added, not replaced)."""
    teacher = teacher_logprobs(teacher_dir, dtype)
    alone, combined, rewarded = (make_learner(tiny_model_dir, dtype, **kwargs) for kwargs in
                                 ({}, {"advantage": "grpo"}, {"advantage": "grpo"}))
    alone.train_step(batch(alone), teacher_logprobs=teacher)
    combined.train_step(batch(combined), teacher_logprobs=teacher)
    rewarded.train_step(batch(rewarded, (1.0, 0.0, 0.0, 1.0)), teacher_logprobs=teacher)
    for (name, a), b, c in zip(alone.model.named_parameters(), combined.model.parameters(),
                               rewarded.model.parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(alone.model.parameters(), rewarded.model.parameters()))


def test_a_teacher_equal_to_the_policy_leaves_the_rewards_advantage_alone(tiny_model_dir):
    """The teacher's advantage is log pi_teacher - log pi: zero when the teacher is the policy itself, so the update
    is GRPO's (to the float noise of the two passes)."""
    plain = make_learner(tiny_model_dir, "float32", advantage="grpo", distill_coef=0.0, ppo_epochs=2)
    taught = make_learner(tiny_model_dir, "float32", advantage="grpo", ppo_epochs=2)
    rewards = (1.0, 0.0, 0.0, 1.0)
    plain.train_step(batch(plain, rewards))
    metrics = taught.train_step(batch(taught, rewards), teacher_logprobs=teacher_logprobs(tiny_model_dir, "float32"))
    assert abs(metrics["distill/reverse_kl"]) < 1e-6
    for (name, a), b in zip(plain.model.named_parameters(), taught.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_without_the_teachers_logprobs_the_step_says_so(tiny_model_dir):
    learner = make_learner(tiny_model_dir, "float32")
    with pytest.raises(ValueError, match="teacher's logprobs"):
        learner.train_step(batch(learner))
    assert learner.weights_version == 0
