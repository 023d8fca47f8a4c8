"""Learner and ReferenceWorker in-process on a tiny random model: the update's direction, micro-batching, the
mismatch metric, non-finite handling and weight export."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actors.reference import ReferenceWorker
from learner.batch import TrainBatch
from learner.config import CriticConfig, LearnerConfig
from learner.learner import Learner, NonFiniteError
from learner.passes.sequences import pad_sequences

PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 12, 4, 15]] * 2  # "37+45=" x2, "1+2=" x2 (char ids)
RESPONSES = [[12, 2, 1], [4, 4, 1], [5, 1], [9, 1]]


def make_learner(model_dir, critic: CriticConfig | None = None, **overrides) -> Learner:
    config = LearnerConfig(**{"lr": 1e-2, "kl_coef": 0.0, "num_threads": 2, **overrides})
    return Learner(str(model_dir), config, seed=0, critic=critic, norm_length=4)


def use_sgd(learner: Learner, lr: float = 0.1) -> None:
    """SGD: Adam would amplify float noise in near-zero gradients into lr-sized steps and hide real differences."""
    learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=lr)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda n: 1.0)


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


def test_metrics_are_means_over_the_updates_made_when_the_batch_is_smaller_than_the_minibatch_count(tiny_model_dir):
    # Groups dropped under on_failure=drop can leave fewer completions than learner.num_minibatches: 4 completions in 8
    # minibatches make 4 updates, and a metric's mean is over those 4 (dividing by 8 would halve every mean).
    learner = make_learner(tiny_model_dir, num_minibatches=8, lr=1e-4)
    metrics = learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0]))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=0.01)  # ~1 in each update: small steps
    assert metrics["train/skipped_updates"] == 0 and metrics["grad_norm"] > 0


def test_micro_batching_does_not_change_the_update(tiny_model_dir):
    whole = make_learner(tiny_model_dir, micro_batch_size=4, kl_coef=0.1)
    split = make_learner(tiny_model_dir, micro_batch_size=1, kl_coef=0.1)
    ref = ReferenceWorker(str(tiny_model_dir)).compute_logprobs(PROMPTS, RESPONSES)
    for learner in (whole, split):
        use_sgd(learner)
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


def test_share_weights_rewrites_one_buffer_only_when_the_weights_or_their_version_change(tiny_model_dir):
    from sync.shared_memory import read_shared

    learner = make_learner(tiny_model_dir)
    first = learner.share_weights(version=1)
    with read_shared(first) as named:
        assert [n for n, _ in named] == list(learner.model.state_dict())
        assert all(torch.equal(t, learner.model.state_dict()[n]) for n, t in named)
        assert learner.share_weights(version=1) == first  # unchanged: not rewritten under a reader (no error here)
    learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0]))
    second = learner.share_weights(version=2)
    assert (second.token, second.version) == (first.token, 2)  # the same buffer, rewritten
    with read_shared(second) as named:
        assert all(torch.equal(t, learner.model.state_dict()[n]) for n, t in named)
    learner.train_step(batch_for(learner, [0.0, 1.0, 1.0, 0.0]))
    with pytest.raises(RuntimeError, match="wrote new weights after this load was asked for"):
        with read_shared(second):
            learner.share_weights(version=2)  # the weights changed under the same version: written again
    with read_shared(learner.share_weights(version=2)) as named:
        assert all(torch.equal(t, learner.model.state_dict()[n]) for n, t in named)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_micro_batching_does_not_change_the_update_in_any_mode(tiny_model_dir, mode, policy_loss):
    # Unequal response lengths (3, 3, 2, 2) make a token-share weighting wrong for these modes.
    kwargs = {"loss_agg": mode, "policy_loss": policy_loss, "entropy_coef": 0.01, "clip_low": 0.01, "clip_high": 0.01}
    whole, split = (make_learner(tiny_model_dir, micro_batch_size=size, **kwargs) for size in (4, 1))
    for learner in (whole, split):
        use_sgd(learner)
        for rewards in ([1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 0.0]):
            learner.train_step(batch_for(learner, rewards))
    for (name, a), b in zip(whole.model.state_dict().items(), split.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=name)


def test_entropy_bonus_raises_the_entropy(tiny_model_dir):
    # Equal rewards: zero advantages, so the entropy term alone moves the policy (plain SGD does not move at all).
    # The random model is near the maximum entropy ln 17 = 2.833, where lr 1 would overshoot; 0.1 gives ~+7e-3.
    plain, bonus = make_learner(tiny_model_dir), make_learner(tiny_model_dir, entropy_coef=1.0)
    metrics = {}
    for learner in (plain, bonus):
        use_sgd(learner, lr=0.1)
        learner.train_step(batch_for(learner, [1.0, 1.0, 1.0, 1.0]))
        metrics[learner is bonus] = learner.train_step(batch_for(learner, [1.0, 1.0, 1.0, 1.0]))
    assert metrics[True]["entropy/mean"] > metrics[False]["entropy/mean"] + 1e-3


def test_kl_in_the_reward_lowers_the_advantage_of_sequences_that_drifted(tiny_model_dir):
    learner = make_learner(tiny_model_dir, kl_reward_coef=1.0, kl_estimator="k1", advantage="rloo")
    ref = [[lp - 0.5 * (i == 0) for lp in row]  # sequence 0: log pi - log pi_ref = 0.5 per token, 3 tokens
           for i, row in enumerate(learner.compute_logprobs(PROMPTS, RESPONSES))]
    before = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    metrics = learner.train_step(batch_for(learner, [1.0, 1.0, 0.0, 0.0], ref))
    after = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    # Equal outcome rewards in group 0, but sequence 0 pays 1.5 of KL: rloo advantages -1.5 and +1.5.
    assert after[0] < before[0] and after[1] > before[1]
    assert metrics["kl/mean"] == pytest.approx(1.5 / 10, abs=1e-5)  # 3 tokens x 0.5 over 10 response tokens


CRITIC = CriticConfig(enabled=True, lr=1e-2)


def test_ppo_trains_a_value_model_towards_the_returns(tiny_model_dir):
    learner = make_learner(tiny_model_dir, critic=CriticConfig(enabled=True, lr=3e-3), advantage="gae", gamma=1.0,
                           lam=1.0)
    assert learner.num_trained_parameters()["critic"] > 0.9 * learner.num_trained_parameters()["policy"]
    batch = pad_sequences(PROMPTS, RESPONSES)
    mask = batch.response_mask.bool()
    assert torch.all(learner.critic.compute_values(batch)[mask] == 0)  # a new head starts at V = 0
    rewards = [1.0, 0.0, 0.0, 1.0]
    losses = [learner.train_step(batch_for(learner, rewards))["loss/value"] for _ in range(15)]
    # gamma = lam = 1, no KL: every token's return is its sequence's reward. V = 0 gives 1/2 x 5 rewarded tokens / 10
    # = 0.25. The first token's state is shared within each pair of sequences (one rewarded, one not), so the best
    # reachable loss is 4 tokens x 1/2 x 0.5^2 / 10 = 0.05.
    assert losses[0] == pytest.approx(0.25) and losses[-1] < 0.4 * losses[0]
    last = [row[m][-1] for row, m in zip(learner.critic.compute_values(batch), mask)]
    assert min(last[0], last[3]) > 0.5 > max(last[1], last[2])  # each sequence's last state sits near its reward


def test_ppo_raises_the_rewarded_completion(tiny_model_dir):
    learner = make_learner(tiny_model_dir, critic=CRITIC, advantage="gae")
    before = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    metrics = learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0]))
    after = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    assert after[0] > before[0] and after[3] > before[3]
    assert after[1] < before[1] and after[2] < before[2]
    assert {"loss/value", "value/clip_fraction", "critic/grad_norm", "returns/mean"} <= set(metrics)


def test_ppo_micro_batching_does_not_change_the_value_update(tiny_model_dir):
    critic = CriticConfig(enabled=True, lr=0.1)
    whole, split = (make_learner(tiny_model_dir, critic=critic, advantage="gae", micro_batch_size=size)
                    for size in (4, 1))
    for learner in (whole, split):
        use_sgd(learner)
        learner.critic.optimizer = torch.optim.SGD(learner.critic.model.parameters(), lr=0.1)
        learner.critic.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.critic.optimizer, lambda n: 1.0)
        for rewards in ([1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 0.0]):
            learner.train_step(batch_for(learner, rewards))
    for (name, a), b in zip(whole.critic.model.state_dict().items(), split.critic.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=name)


def test_gae_without_a_critic_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="gae needs one"):
        make_learner(tiny_model_dir, advantage="gae")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reinforce_with_the_group_mean_baseline_is_dr_grpo_for_one_update(tiny_model_dir, dtype):
    """gamma 1 and an outcome reward only: every token's return is its sequence's reward, and minus the group's mean
    that is Dr.GRPO's advantage; at one update per batch the vanilla loss has PPO's gradient. The same update."""
    learners = []
    for overrides in ({"advantage": "reinforce", "baseline": "group_mean", "policy_loss": "vanilla"},
                      {"advantage": "grpo", "group_scale": "none", "policy_loss": "ppo"}):
        config = LearnerConfig(lr=1e-2, kl_coef=0.0, num_threads=2, **overrides)
        learner = Learner(str(tiny_model_dir), config, dtype=dtype, seed=0, norm_length=4)
        use_sgd(learner)
        metrics = learner.train_step(batch_for(learner, [1.0, 0.0, 0.5, 1.0]))
        learners.append((learner, metrics))
    (reinforce, ours), (dr_grpo, theirs) = learners
    assert ours["returns/mean"] == pytest.approx((3 * 1.0 + 3 * 0.0 + 2 * 0.5 + 2 * 1.0) / 10)  # G_t = r per token
    assert ours["advantage/mean_abs"] == pytest.approx(theirs["advantage/mean_abs"])
    for (name, a), b in zip(reinforce.model.state_dict().items(), dr_grpo.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_reinforce_with_the_value_baseline_trains_a_value_model_on_the_returns(tiny_model_dir):
    learner = make_learner(tiny_model_dir, critic=CriticConfig(enabled=True, lr=3e-3), advantage="reinforce",
                           baseline="value", policy_loss="vanilla")
    before = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    losses = [learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0]))["loss/value"] for _ in range(10)]
    assert losses[0] == pytest.approx(0.25) and losses[-1] < 0.6 * losses[0]  # V = 0 against G_t = r, as for PPO
    after = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    assert after[0] > before[0] and after[3] > before[3] and after[1] < before[1] and after[2] < before[2]
    with pytest.raises(ValueError, match="baseline 'value'"):
        make_learner(tiny_model_dir, advantage="reinforce", baseline="value")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tis_weighs_the_gradient_by_the_capped_ratio_and_reports_the_mismatch(tiny_model_dir, dtype):
    """Behaviour logprobs ln 2 below the learner's: rho = 2 on every token, above the cap 1.5, so TIS weighs every
    token's term by 1.5 and the gradient grows by exactly that factor."""
    norms = {}
    for mode in ("none", "tis"):
        config = LearnerConfig(lr=1e-2, kl_coef=0.0, num_threads=2, rollout_correction=mode,
                               rollout_correction_cap=1.5)
        learner = Learner(str(tiny_model_dir), config, dtype=dtype, seed=0, norm_length=4)
        behavior = [[lp - math.log(2) for lp in row] for row in learner.compute_logprobs(PROMPTS, RESPONSES)]
        metrics = learner.train_step(TrainBatch(PROMPTS, RESPONSES, behavior, [1.0, 0.0, 0.0, 1.0], 2))
        norms[mode] = metrics["grad_norm"]
        assert metrics["mismatch/kl"] == pytest.approx(1 - math.log(2), abs=1e-3)  # k3 at rho = 2
    assert metrics["rollout_correction/capped_fraction"] == 1.0
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(1.5)
    assert norms["tis"] / norms["none"] == pytest.approx(1.5, rel=1e-2 if dtype == "bfloat16" else 1e-5)


def progress(learner: Learner, steps: int) -> float:
    """`steps` on-policy updates on one fixed batch; how far the rewarded completions' log-probability rose (and the
    others' fell), measured by the learner's own forward pass."""
    rewards = [1.0, 0.0, 0.0, 1.0]
    before = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    for _ in range(steps):
        learner.train_step(batch_for(learner, rewards))
    after = [sum(lp) for lp in learner.compute_logprobs(PROMPTS, RESPONSES)]
    return sum((a - b) * (1 if r else -1) for a, b, r in zip(after, before, rewards))


def test_bfloat16_with_float32_master_weights_learns_like_float32_at_a_small_learning_rate(tiny_model_dir):
    """lr 1e-6, as real bfloat16 runs use: each AdamW step is far below half a bfloat16 ulp of most weights, so
    bfloat16 parameters round most updates away, while float32 master weights keep them (the forward still runs in
    bfloat16). Measured here: float32 master ~0.99x of float32's progress over 30 steps, pure bfloat16 ~0.05x."""
    def learner(dtype: str, master: str) -> Learner:
        config = LearnerConfig(lr=1e-6, warmup_steps=0, kl_coef=0.0, num_threads=2, master_dtype=master)
        return Learner(str(tiny_model_dir), config, dtype=dtype, seed=0, norm_length=4)

    full = progress(learner("float32", "float32"), 30)
    mixed = progress(learner("bfloat16", "float32"), 30)
    pure = progress(learner("bfloat16", "bfloat16"), 30)
    assert full > 0 and mixed >= 0.5 * full, (full, mixed)
    assert pure < 0.5 * full, (full, pure)  # what the float32 master weights fix: the test can tell them apart


def test_mixed_precision_keeps_float32_master_weights_and_hands_engines_bfloat16(tiny_model_dir):
    from learner.passes.sequences import sequence_logprobs
    from sync.shared_memory import read_shared

    # Whole rows (no shared prompts): the forward compared bitwise below runs the same matmul shapes.
    config = LearnerConfig(lr=1e-2, kl_coef=0.0, num_threads=2, share_prompts=False)
    learner = Learner(str(tiny_model_dir), config, dtype="bfloat16", seed=0, norm_length=4)
    learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0]))
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    assert {t.dtype for s in learner.optimizer.state.values() for t in s.values() if t.dim()} == {torch.float32}
    # The forward runs in bfloat16: it is the float32 weights under autocast, not the float32 forward.
    batch = pad_sequences(PROMPTS, RESPONSES, learner.pad_id)
    ours = torch.tensor([lp for row in learner.compute_logprobs(PROMPTS, RESPONSES) for lp in row])
    with torch.no_grad():
        full = sequence_logprobs(learner.model, batch)[batch.response_mask.bool()]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = sequence_logprobs(learner.model, batch)[batch.response_mask.bool()]
    assert torch.equal(ours, autocast) and (ours - full).abs().max() > 1e-4
    # Engines get the master weights cast to bfloat16, by every path.
    state = learner.model.state_dict()
    exported = learner.export_weights(bucket_bytes=64 * 64 * 2)
    assert [n for b in exported for n, _ in b] == list(state)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, state[n].to(torch.bfloat16)) for b in exported
               for n, t in b)
    assert all(sum(t.nbytes for _, t in b) <= 64 * 64 * 2 or len(b) == 1 for b in exported)
    assert learner.count_buckets(64 * 64 * 2) == len(exported)
    with read_shared(learner.share_weights(version=1)) as named:
        assert all(t.dtype == torch.bfloat16 and torch.equal(t, state[n].to(torch.bfloat16)) for n, t in named)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_references_flat_logprobs_train_exactly_like_its_rows_and_the_learner_returns_its_version(
        tiny_model_dir, dtype):
    """The reference's logprobs reach the learner as one flat array by object ref (never as lists through the
    driver): the update is bitwise the one from per-row lists, and `train_step` returns the version it produced."""
    reference = ReferenceWorker(str(tiny_model_dir), dtype=dtype)
    rows = reference.compute_logprobs(PROMPTS, RESPONSES)
    count, flat = reference.compute_flat_logprobs(PROMPTS, RESPONSES)
    assert isinstance(flat, np.ndarray) and flat.dtype == np.float32 and count == len(flat)
    assert flat.tolist() == [lp for row in rows for lp in row]
    config = LearnerConfig(lr=1e-2, kl_coef=0.1, num_minibatches=2, num_threads=2)  # the 2nd update sees a KL
    learners = [Learner(str(tiny_model_dir), config, dtype=dtype, seed=0)
                for _ in range(2)]
    by_rows = learners[0].train_step(batch_for(learners[0], [1.0, 0.0, 0.5, 1.0], rows))
    by_ref = learners[1].train_step(batch_for(learners[1], [1.0, 0.0, 0.5, 1.0]), ref_logprobs=flat)
    computed = [key for key in by_rows if not key.startswith("memory/")]  # the process's RSS is not the update's
    assert by_rows["kl/mean"] > 0 and {k: by_rows[k] for k in computed} == {k: by_ref[k] for k in computed}
    assert by_ref["weights/version"] == learners[1].weights_version == 1
    for a, b in zip(learners[0].model.state_dict().values(), learners[1].model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kl", [{"kl_coef": 0.1}, {"kl_coef": 0.1, "num_minibatches": 2},
                                {"kl_coef": 0.0, "kl_reward_coef": 0.1}], ids=["loss", "loss-2-updates", "reward"])
def test_reference_logprobs_still_on_their_way_are_waited_for_after_the_training_forward(tiny_model_dir, dtype, kl):
    """The on-policy step hands the learner the reference's logprobs before they exist (`sync.calls.Later`): with
    the KL in the loss it waits for them only after its first training forward, with the KL in the reward before
    anything; either way the update is bitwise the one from the array, for one update or two. A wait that fails
    leaves the learner as it was: the next update is the one a fresh learner makes."""
    reference = ReferenceWorker(str(tiny_model_dir), dtype=dtype)
    flat = reference.compute_flat_logprobs(PROMPTS, RESPONSES)[1] - 0.1  # a KL from the first forward on
    config = LearnerConfig(lr=1e-2, num_threads=2, **kl)
    learners = [Learner(str(tiny_model_dir), config, dtype=dtype, seed=0) for _ in range(3)]
    forwards = []  # training (grad-enabled) forwards of learners[1]'s policy
    learners[1].model.register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    waited = []  # the training forwards (the prompts' pass and the first pass's) done when it asked for the logprobs

    def later() -> np.ndarray:
        waited.append(sum(forwards))
        return flat

    rewards = [1.0, 0.0, 0.5, 1.0]
    by_array = learners[0].train_step(batch_for(learners[0], rewards), ref_logprobs=flat)
    by_later = learners[1].train_step(batch_for(learners[1], rewards), ref_logprobs=later)
    assert len(waited) == 1 and (waited[0] == 0 if "kl_reward_coef" in kl else waited[0] > 0)  # once: the first loss
    computed = [key for key in by_array if not key.startswith("memory/")]
    assert by_array["kl/mean"] > 0 and {k: by_array[k] for k in computed} == {k: by_later[k] for k in computed}
    for a, b in zip(learners[0].model.state_dict().values(), learners[1].model.state_dict().values()):
        assert torch.equal(a, b)

    def never() -> np.ndarray:
        raise TimeoutError("reference missed the 600 s deadline of 'reference'")

    with pytest.raises(TimeoutError):
        learners[2].train_step(batch_for(learners[2], [0.0, 1.0, 1.0, 0.5]), ref_logprobs=never)
    assert learners[2].weights_version == 0
    again = learners[2].train_step(batch_for(learners[2], rewards), ref_logprobs=flat)
    assert {k: by_array[k] for k in computed} == {k: again[k] for k in computed}
    for a, b in zip(learners[0].model.state_dict().values(), learners[2].model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_probe_sample_is_seeded_scored_at_temperature_one_and_leaves_the_random_state(tiny_model_dir, dtype):
    learner = Learner(str(tiny_model_dir), LearnerConfig(num_threads=2), dtype=dtype, temperature=0.7)
    state = torch.get_rng_state()
    prompt, response, logprobs, seed = learner.probe_sample([5, 9, 12], 6, 0.7, seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # exact resume: the update's random state is not touched
    assert (prompt, seed) == ([5, 9, 12], 3) and 1 <= len(response) <= 6 and len(logprobs) == len(response)
    assert learner.probe_sample([5, 9, 12], 6, 0.7, seed=3)[1] == response  # the same seed, the same tokens
    assert any(learner.probe_sample([5, 9, 12], 6, 0.7, seed=s)[1] != response for s in range(4, 8))
    assert logprobs == learner.compute_logprobs([prompt], [response], temperature=1.0)[0]
    assert logprobs != learner.compute_logprobs([prompt], [response])[0]  # not at the sampling temperature


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_takes_the_learners_weights_reports_them_and_saves_them(tiny_model_dir, tmp_path, dtype):
    """Iterative GRPO's refresh, in-process: after an update the reference takes the learner's exported buckets,
    reports exactly the learner's fingerprints of them, scores as the learner does, and keeps them across a
    save and a restore into a fresh reference."""
    config = LearnerConfig(lr=1e-2, kl_coef=0.0, num_threads=2)
    learner = Learner(str(tiny_model_dir), config, dtype=dtype, seed=0, norm_length=4)
    learner.train_step(batch_for(learner, [1.0, 0.0, 0.0, 1.0]))
    reference = ReferenceWorker(str(tiny_model_dir), dtype=dtype)
    tol = 1e-5 if dtype == "float32" else 0.05
    ours = learner.compute_logprobs(PROMPTS, RESPONSES)
    initial = reference.compute_logprobs(PROMPTS, RESPONSES)
    assert max(abs(a - b) for x, y in zip(ours, initial) for a, b in zip(x, y)) > 10 * tol  # the update moved them
    loaded = reference.load_weights(1, *learner.export_weights(bucket_bytes=64 * 64 * 2))
    assert loaded.version == 1 and loaded.fingerprints == (learner.weights_fingerprint(),)
    theirs = reference.compute_logprobs(PROMPTS, RESPONSES)
    assert max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)) < tol
    reference.save_weights(str(tmp_path / "reference"))
    fresh = ReferenceWorker(str(tiny_model_dir), dtype=dtype)
    fresh.load_saved(str(tmp_path / "reference"))
    assert fresh.compute_logprobs(PROMPTS, RESPONSES) == theirs  # bit for bit
    partial = learner.export_weights(bucket_bytes=2**40)[0][1:]
    with pytest.raises(KeyError, match="lack 1 of the reference's parameters"):
        fresh.load_weights(2, partial)


def step_rows(ends: list[list[int]], rewards: list[list[float]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Dense per-token step rows (the driver's `token_step_rewards`) for RESPONSES."""
    from rewards.steps import token_step_rewards

    dense = [token_step_rewards(np.array(e), np.array(r, np.float32), len(resp))
             for e, r, resp in zip(ends, rewards, RESPONSES)]
    return [d[0] for d in dense], [d[1] for d in dense]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_process_supervision_with_one_step_per_completion_is_grpo_and_with_two_it_is_not(tiny_model_dir, dtype):
    """One step per completion (ending at its last token) with reward 0 and the outcome reward r: the group's step
    rewards are the outcome rewards, so the update is GRPO's, bit for bit. Rewarding the first of two steps instead
    moves the weights elsewhere, and the advantage's size matches the hand-computed process advantages."""
    outcome = [1.0, 0.0, 0.5, 1.0]

    def trained(steps: tuple | None, rewards=outcome) -> tuple[Learner, dict]:
        learner = Learner(str(tiny_model_dir), LearnerConfig(lr=1e-2, kl_coef=0.0, num_threads=2), dtype=dtype, seed=0,
                          norm_length=4)
        use_sgd(learner)
        batch = batch_for(learner, rewards)
        if steps is not None:
            batch.step_rewards, batch.step_ends = step_rows(*steps)
        return learner, learner.train_step(batch)

    plain, plain_metrics = trained(None)
    last = [[len(r) - 1] for r in RESPONSES]
    one_step, one_metrics = trained((last, [[0.0]] * 4))
    for (name, a), b in zip(plain.model.state_dict().items(), one_step.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert one_metrics["advantage/mean_abs"] == plain_metrics["advantage/mean_abs"]
    # Two steps in the 3-token responses (ends 0 and 2), one in the 2-token ones; step rewards only (outcome 0).
    # Group 0 step rewards (1, 0 | 0, 0): mean 1/4, std 1/2: (1.5, -0.5 | -0.5, -0.5); tokens: row 0 (1, -0.5, -0.5),
    # row 1 (-1, -0.5, -0.5). Group 1 (1 | 0): (0.7071, -0.7071) over 2 tokens each. Token-mean of |A|:
    # (2 + 2 + 4 x 0.7071) / 10.
    two_step, two_metrics = trained(([[0, 2], [0, 2], [1], [1]], [[1.0, 0.0], [0.0, 0.0], [1.0], [0.0]]),
                                    rewards=[0.0] * 4)
    assert two_metrics["advantage/mean_abs"] == pytest.approx((2 + 2 + 4 * math.sqrt(0.5)) / 10, abs=1e-5)
    assert not all(torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(),
                                                      two_step.model.state_dict().values()))
