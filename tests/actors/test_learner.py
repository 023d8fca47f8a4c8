"""Learner and ReferenceWorker in-process on a tiny random model: the update's direction, micro-batching, the
mismatch metric, non-finite handling and weight export."""

from __future__ import annotations

import math

import pytest
import torch

from actors.reference import ReferenceWorker
from cluster.config import LearnerConfig
from learner.learner import Learner, NonFiniteError, TrainBatch

PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 12, 4, 15]] * 2  # "37+45=" x2, "1+2=" x2 (char ids)
RESPONSES = [[12, 2, 1], [4, 4, 1], [5, 1], [9, 1]]


def make_learner(model_dir, **overrides) -> Learner:
    config = LearnerConfig(**{"lr": 1e-2, "kl_coef": 0.0, "num_threads": 2, **overrides})
    return Learner(str(model_dir), config, seed=0)


def batch_for(learner: Learner, rewards, ref=None) -> TrainBatch:
    return TrainBatch(PROMPTS, RESPONSES, learner.compute_logprobs(PROMPTS, RESPONSES), list(rewards), 2, ref)


def test_update_raises_the_rewarded_completion(tiny_model_dir):
    learner = make_learner(tiny_model_dir)
    before = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    metrics = learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0]))
    after = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    assert after[0] > before[0] and after[3] > before[3]  # advantage +1/(std+eps)
    assert after[1] < before[1] and after[2] < before[2]  # advantage -1/(std+eps)
    assert learner.weights_version == 1
    assert metrics["grad_norm"] > 0 and metrics["train/skipped_updates"] == 0
    assert metrics["logprob/mismatch"] < 1e-6  # behaviour logprobs came from the same weights


def test_mismatch_metric_measures_behaviour_vs_old_logprobs(tiny_model_dir):
    learner = make_learner(tiny_model_dir)
    batch = batch_for(learner, [1.0, 0.0, 0.0, 1.0])
    batch.behavior_logprobs = [[lp + 0.5 for lp in row] for row in batch.behavior_logprobs]
    assert learner.train_step(batch)["logprob/mismatch"] == pytest.approx(0.5, abs=1e-5)


def test_micro_batching_does_not_change_the_update(tiny_model_dir):
    whole = make_learner(tiny_model_dir, micro_batch_size=4, kl_coef=0.1)
    split = make_learner(tiny_model_dir, micro_batch_size=1, kl_coef=0.1)
    ref = ReferenceWorker(str(tiny_model_dir)).compute_logprobs(PROMPTS, RESPONSES)
    for learner in (whole, split):
        # SGD: Adam would amplify float noise in near-zero gradients into lr-sized steps and hide real differences
        learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=0.1)
        learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda n: 1.0)
        learner.train_step(batch_for(learner, [1.0, 0.0, 0.5, 1.0], ref))
        learner.train_step(batch_for(learner, [0.0, 1.0, 1.0, 0.0], ref))  # second step: KL and ratios non-trivial
    for (name, a), b in zip(whole.model.state_dict().items(), split.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=name)


def test_reference_matches_the_initial_policy_and_stays_frozen(tiny_model_dir):
    reference = ReferenceWorker(str(tiny_model_dir))
    learner = make_learner(tiny_model_dir)
    initial = learner.compute_logprobs(PROMPTS, RESPONSES)
    for ours, theirs in zip(reference.compute_logprobs(PROMPTS, RESPONSES), initial):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-6, rtol=0)
    learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0], reference.compute_logprobs(PROMPTS, RESPONSES)))
    assert not any(p.requires_grad for p in reference.model.parameters())
    for ours, theirs in zip(reference.compute_logprobs(PROMPTS, RESPONSES), initial):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-6, rtol=0)


def test_non_finite_update_is_skipped_then_stops_the_run(tiny_model_dir):
    learner = make_learner(tiny_model_dir, max_nonfinite_steps=2)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    metrics = learner.train_step(batch_for(learner, [math.nan, 0.0, 0.0, 1.0]))
    assert metrics["train/skipped_updates"] == 1
    for name, value in learner.model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed on a skipped update"
    with pytest.raises(NonFiniteError, match="2 updates in a row"):
        learner.train_step(batch_for(learner, [math.nan, 0.0, 0.0, 1.0]))


def test_export_weights_in_buckets(tiny_model_dir):
    learner = make_learner(tiny_model_dir)
    names = list(learner.model.state_dict())
    one = learner.export_weights(bucket_bytes=2**40)
    assert len(one) == 1 and [n for n, _ in one[0]] == names
    small = learner.export_weights(bucket_bytes=64 * 64 * 4)  # one 64x64 fp32 matrix per bucket at most
    assert len(small) > 2 and [n for b in small for n, _ in b] == names
    assert all(sum(a.nbytes for _, a in b) <= 64 * 64 * 4 or len(b) == 1 for b in small)
    state = learner.model.state_dict()
    for name, array in (pair for b in small for pair in b):
        assert torch.equal(torch.from_numpy(array), state[name])
    assert learner.count_buckets(64 * 64 * 4) == len(small)
