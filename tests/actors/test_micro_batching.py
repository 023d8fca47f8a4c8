"""Passes cut by a token budget over length-sorted rows, and the single-update path that takes old logprobs from the
training forward: the Learner's update (every gradient and metric) equals the one-pass computation, in every
aggregation mode, on ragged lengths, in float32 and under bfloat16 compute; the reference's logprobs do not depend
on how their passes are cut."""

from __future__ import annotations

import math

import pytest
import torch

from actors.reference import ReferenceWorker
from learner.algo.sequences import MicroBatching
from learner.config import LearnerConfig
from learner.learner import Learner, TrainBatch

# Four groups of two; prompts of 2 to 6 tokens, responses of 1 to 7: sequences of 3 to 12 tokens.
PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 15]] * 2 + [[9, 12, 9, 15]] * 2 + [[4, 12, 15]] * 2
RESPONSES = [[12, 2, 1], [4, 4, 7, 8, 2, 9, 1], [5], [9, 3, 1], [13, 1], [3, 12, 2, 4, 1], [7, 7, 7, 7, 7, 1], [2, 1]]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 1.0, 0.0]
BUDGET = 16  # padded tokens per pass: the 8 rows go in 5 passes of 1 or 2 rows, each padded to its own longest
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# Tolerance of the weight change (= -gradient, SGD lr 1, no clipping), relative to the largest element of the
# expected change and as the relative norm of the difference. float32: only summation order differs; measured
# 3e-7 (norm) and 1e-6 of the largest element at worst. bfloat16 compute: a row's logits depend on how much
# padding its pass carries (other matmul shapes round differently); measured up to 1.2e-2 (norm) and 1.5e-2 of the
# largest element (seq-mean-token-sum). A real mistake (a wrong normaliser, a lost pass) is 10% or more.
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 3e-2)}  # (element / largest, norm)
# Of every metric, relative. bfloat16: the same padding effect; differences of logprobs move most (approx_kl: 2.6%
# on an AVX2 CPU, whose bfloat16 kernels round differently from AVX-512's).
METRIC_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def make(model_dir, dtype: str, **overrides) -> Learner:
    config = LearnerConfig(**{"lr": 1.0, "warmup_steps": 0, "kl_coef": 0.1, "entropy_coef": 0.01, "num_threads": 2,
                              "max_grad_norm": 1e9, **overrides})
    learner = Learner(str(model_dir), config, dtype=dtype, seed=0, norm_length=8)
    learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=1.0)  # the step is -gradient
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda n: 1.0)
    return learner


def update(learner: Learner, behavior, ref) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """One train_step: the weight change per tensor, the metrics, and how many forward passes the policy made."""
    before = {name: tensor.detach().clone() for name, tensor in learner.model.state_dict().items()}
    passes = []
    hook = learner.model.register_forward_hook(lambda module, args, kwargs, out: passes.append(kwargs["input_ids"]),
                                               with_kwargs=True)
    try:
        metrics = learner.train_step(TrainBatch(PROMPTS, RESPONSES, behavior, REWARDS, 2, ref))
    finally:
        hook.remove()
    after = learner.model.state_dict()
    assert all(ids.numel() <= BUDGET or len(ids) == 1 for ids in passes if learner.batching.max_tokens == BUDGET)
    return {name: after[name] - before[name] for name in before}, metrics, len(passes)


def inputs(model_dir, dtype: str):
    """The engines' logprobs (the base weights, shifted so the mismatch metrics are not 0) and the reference's."""
    base = make(model_dir, dtype)
    behavior = [[lp + 0.01 * (i % 3) for lp in row] for i, row in enumerate(base.compute_logprobs(PROMPTS, RESPONSES))]
    ref = ReferenceWorker(str(model_dir), dtype).compute_logprobs(PROMPTS, RESPONSES)
    return behavior, [[lp - 0.05 * (i % 2) for lp in row] for i, row in enumerate(ref)]


def assert_same_update(ours, theirs, dtype: str) -> None:
    (delta, metrics, _), (expected_delta, expected_metrics, _) = ours, theirs
    element, norm = TOLERANCE[dtype]
    changed = torch.cat([d.flatten() for d in expected_delta.values()])
    assert changed.abs().max() > 1e-3  # the update is not trivially zero
    for name in expected_delta:
        torch.testing.assert_close(delta[name], expected_delta[name], msg=name, rtol=0,
                                   atol=element * float(changed.abs().max()))
    total = torch.cat([d.flatten() for d in delta.values()])
    assert (total - changed).norm() / changed.norm() < norm
    assert metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        if not name.startswith(("memory/", "grad_norm")):
            assert metrics[name] == pytest.approx(value, rel=METRIC_TOLERANCE[dtype], abs=1e-6), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_token_budget_passes_make_the_one_pass_update_in_every_mode(tiny_model_dir, dtype, mode):
    behavior, ref = inputs(tiny_model_dir, dtype)
    for policy_loss in (["ppo", "gspo"] if mode == "seq-mean-token-mean" else ["ppo"]):
        settings = dict(loss_agg=mode, policy_loss=policy_loss, num_minibatches=2)  # two updates: pi_old its own pass
        whole = update(make(tiny_model_dir, dtype, max_tokens_per_micro_batch=None, **settings), behavior, ref)
        split = update(make(tiny_model_dir, dtype, max_tokens_per_micro_batch=BUDGET, **settings), behavior, ref)
        assert whole[2] == 1 + 2 and split[2] > whole[2] + 4  # pi_old + one pass per minibatch; 5 + 4 or 5 passes
        assert_same_update(split, whole, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_one_update_per_batch_takes_old_logprobs_from_the_training_forward(tiny_model_dir, dtype, mode):
    behavior, ref = inputs(tiny_model_dir, dtype)
    fused = make(tiny_model_dir, dtype, loss_agg=mode, max_tokens_per_micro_batch=BUDGET)
    separate = make(tiny_model_dir, dtype, loss_agg=mode, max_tokens_per_micro_batch=BUDGET)
    assert fused.single_update
    separate.single_update = False  # the general path: a no-grad pass for pi_old first
    ours, theirs = update(fused, behavior, ref), update(separate, behavior, ref)
    assert theirs[2] == 2 * ours[2]  # the same passes, without the no-grad one over the batch
    assert_same_update(ours, theirs, dtype)
    metrics = ours[1]
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0  # pi_old is this very forward
    # The mismatch metrics measure the engines' shift (0.01 on two rows of three), not 0.
    assert metrics["logprob/mismatch"] == pytest.approx(theirs[1]["logprob/mismatch"], abs=1e-6)
    assert metrics["logprob/mismatch"] > 0.003 and metrics["mismatch/kl"] > 1e-5


def test_the_general_path_is_kept_whenever_pi_old_is_needed_before_or_across_updates(tiny_model_dir):
    assert make(tiny_model_dir, "float32").single_update
    for settings in (dict(ppo_epochs=2), dict(num_minibatches=2), dict(kl_coef=0.0, kl_reward_coef=0.1)):
        assert not make(tiny_model_dir, "float32", **settings).single_update, settings


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("correction", [("tis", "token"), ("mis", "sequence"), ("tis", "sequence")])
def test_one_update_per_batch_takes_the_rollout_correction_from_the_training_forward(tiny_model_dir, dtype,
                                                                                     correction):
    """Decoupled PPO's weights pi_proximal / pi_behavior (asynchronous training) need no pass of their own either:
    per token, and per sequence (a row is never split across passes)."""
    mode, level = correction
    settings = dict(rollout_correction=mode, rollout_correction_level=level, rollout_correction_cap=math.exp(0.1),
                    max_tokens_per_micro_batch=BUDGET)
    behavior, ref = inputs(tiny_model_dir, dtype)
    # log rho = -0.2, ~0 or +0.2 per row (by i % 3): beyond the cap (e^0.1) both ways, or well inside it.
    behavior = [[lp + 0.2 * ((i + 1) % 3 - 1) for lp in row] for i, row in enumerate(behavior)]
    fused, separate = make(tiny_model_dir, dtype, **settings), make(tiny_model_dir, dtype, **settings)
    assert fused.single_update
    separate.single_update = False
    ours, theirs = update(fused, behavior, ref), update(separate, behavior, ref)
    assert theirs[2] == 2 * ours[2]
    assert_same_update(ours, theirs, dtype)
    name = "capped_fraction" if mode == "tis" else "masked_fraction"
    assert 0 < ours[1][f"rollout_correction/{name}"] < 1  # the cap bites on some tokens (or sequences), not all


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_logprobs_do_not_depend_on_the_passes(tiny_model_dir, dtype):
    one = ReferenceWorker(str(tiny_model_dir), dtype, batching=MicroBatching()).compute_logprobs(PROMPTS, RESPONSES)
    for batching in (MicroBatching(max_tokens=BUDGET), MicroBatching(max_rows=1), MicroBatching(3, 20)):
        cut = ReferenceWorker(str(tiny_model_dir), dtype, batching=batching).compute_logprobs(PROMPTS, RESPONSES)
        for ours, theirs in zip(cut, one):
            # float32: the same values up to summation order; bfloat16: padding changes the matmul shapes' rounding
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0,
                                       atol=1e-5 if dtype == "float32" else 0.05)
