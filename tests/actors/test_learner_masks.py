"""Multi-turn episodes in the Learner (issue 19): the environment's tokens inside a response are context, never
training data. On the tiny random model, float32 and bfloat16: the update with `model_masks` is the one a loss built
by hand over the model's tokens alone makes (GRPO, and PPO's GAE with its value model); what lies at the
environment's positions (behaviour and reference logprobs) changes nothing; all-ones masks are no masks, bit for bit;
micro-batches, token budgets and ranks keep every aggregation mode exact."""

from __future__ import annotations

import functools
import math
import pickle

import numpy as np
import pytest
import torch

from learner.batch import TrainBatch
from learner.config import CriticConfig, LearnerConfig
from learner.distributed import DataParallel
from learner.learner import Learner
from learner.passes.sequences import Rows, pad_sequences, sequence_logprobs_and_entropy
from tests.actors import test_micro_batching as eight  # its 8 rows of 1 to 7 response tokens
from tests.actors.test_learner import PROMPTS, RESPONSES, use_sgd
from tests.actors.test_micro_batching import BUDGET, MODES, TOLERANCE, assert_same_update

# Episodes for PROMPTS: model tokens (1) and the environment's (0). Row 1 has none of the environment's; row 3 ends
# with one (the environment spoke last).
EPISODES = [[12, 2, 7, 8, 1], [4, 4, 1], [5, 3, 3, 9, 1], [9, 1, 6]]
MODEL_MASKS = [[1, 1, 0, 0, 1], [1, 1, 1], [1, 0, 0, 1, 1], [1, 1, 0]]
REWARDS = [1.0, 0.0, 0.5, 1.0]
# For the 8 rows of test_micro_batching: environment segments in the middle, at the end, and rows without any.
EIGHT_MASKS = [[1, 1, 1], [1, 1, 0, 0, 1, 1, 1], [1], [1, 0, 1], [1, 1], [1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0], [1, 1]]


def build(model_dir, dtype: str = "float32", critic: bool = False, **overrides) -> Learner:
    """lr 1 SGD without clipping (policy and value model): each weight moves by exactly -gradient."""
    config = LearnerConfig(**{"lr": 1.0, "warmup_steps": 0, "kl_coef": 0.1, "entropy_coef": 0.01, "num_threads": 2,
                              "max_grad_norm": 1e9, **overrides})
    critic_config = CriticConfig(enabled=True, lr=1.0, max_grad_norm=1e9) if critic else None
    learner = Learner(str(model_dir), config, dtype=dtype, seed=0, critic=critic_config, norm_length=8)
    use_sgd(learner, lr=1.0)
    if learner.critic:
        learner.critic.optimizer = torch.optim.SGD(learner.critic.model.parameters(), lr=1.0)
        learner.critic.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.critic.optimizer, lambda n: 1.0)
    return learner


def episodes(learner: Learner, prompts=PROMPTS, responses=EPISODES, masks=MODEL_MASKS, rewards=REWARDS,
             env_behavior: float = 0.0, env_ref: float | None = None) -> TrainBatch:
    """The batch a multi-turn rollout hands over: behaviour logprobs from the learner's own weights shifted by
    0.01 ((i % 3) - 1) (a mismatch both ways) at model tokens and `env_behavior` at the environment's (the
    rollout's 0.0); reference logprobs 0.05 (i % 2) below the learner's at every token (a KL to penalise), or
    `env_ref` at the environment's."""
    own = learner.compute_logprobs(prompts, responses)
    behavior = [[lp + 0.01 * (i % 3 - 1) if m else env_behavior for lp, m in zip(row, mask)]
                for i, (row, mask) in enumerate(zip(own, masks))]
    ref = [[lp - 0.05 * (i % 2) if m or env_ref is None else env_ref for lp, m in zip(row, mask)]
           for i, (row, mask) in enumerate(zip(own, masks))]
    return TrainBatch(prompts, responses, behavior, list(rewards), 2, ref, model_masks=masks)


def update(learner: Learner, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """One train_step: the change of every weight (policy, then value model as `critic.<name>`) and the metrics (the
    process's memory left out), in `assert_same_update`'s form."""
    def state() -> dict[str, torch.Tensor]:
        named = {name: t.detach().clone() for name, t in learner.model.state_dict().items()}
        if learner.critic:
            named |= {f"critic.{name}": t.detach().clone() for name, t in learner.critic.model.state_dict().items()}
        return named

    before = state()
    metrics = learner.train_step(batch)
    after = state()
    return ({name: after[name] - before[name] for name in before},
            {k: v for k, v in metrics.items() if not k.startswith("memory/")}, 0)


def at_model_tokens(prompts, masks, width: int, values=None) -> torch.Tensor:
    """[B, width] in the learner's layout, built by hand: response token t of row i is predicted at position
    len(prompt_i) - 1 + t; 1 there (or values[i][t]) for the model's tokens, 0 everywhere else."""
    out = torch.zeros(len(prompts), width)
    for i, (prompt, mask) in enumerate(zip(prompts, masks)):
        for t, m in enumerate(mask):
            if m:
                out[i, len(prompt) - 1 + t] = 1.0 if values is None else values[i][t]
    return out


def hand_update(learner: Learner, batch: TrainBatch, advantages: torch.Tensor, returns: torch.Tensor | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """The one-update loss over the model's tokens alone, by hand, from `learner`'s forward (same weights, same
    precision): token means over the N model tokens of -A_t r_t (r_t = 1: pi_old is this very forward)
    + kl_coef k3(pi, pi_ref) - entropy_coef H_t, and with `returns`, the value loss 1/2 (V_t - R_t)^2 (V = V_old at
    the first update: the clipped term is the same). Returns -gradient, the update SGD lr 1 makes, and the metrics."""
    cfg = learner.config
    seqs = pad_sequences(batch.prompt_ids, batch.response_ids)  # no model masks: the plain layout
    width = seqs.response_mask.shape[1]
    m = at_model_tokens(batch.prompt_ids, batch.model_masks, width)
    n = m.sum()

    def mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(m.bool(), values, 0.0).sum() / n

    with learner._compute():
        logprobs, entropy = sequence_logprobs_and_entropy(learner.model, seqs, learner.temperature)
    ratio = torch.exp(logprobs - logprobs.detach())
    log_r = torch.where(m.bool(), at_model_tokens(batch.prompt_ids, batch.model_masks, width, batch.ref_logprobs)
                        - logprobs, 0.0)  # log pi_ref / pi
    k3 = torch.exp(log_r) - log_r - 1
    policy = mean(-advantages * ratio)
    (policy + cfg.kl_coef * mean(k3) - cfg.entropy_coef * mean(entropy)).backward()
    behavior = at_model_tokens(batch.prompt_ids, batch.model_masks, width, batch.behavior_logprobs)
    with torch.no_grad():
        metrics = {"loss/policy": float(policy), "kl/mean": float(mean(k3)), "entropy/mean": float(mean(entropy)),
                   "logprob/mismatch": float(mean((behavior - logprobs).abs())),
                   "advantage/mean_abs": float(mean(advantages.abs()))}
    named = dict(learner.model.named_parameters())
    if returns is not None:
        values = learner.critic.values(seqs)
        value_loss = mean(0.5 * (values - returns).square())
        value_loss.backward()
        metrics |= {"loss/value": float(value_loss.detach()), "returns/mean": float(mean(returns))}
        named |= {f"critic.{name}": p for name, p in learner.critic.model.named_parameters()}
    return {name: -p.grad for name, p in named.items()}, metrics, 0


def assert_hand_update(ours, theirs, dtype: str) -> None:
    """Every weight's change within TOLERANCE (float32: 1e-5 of the largest change; the hand loss sums in another
    order), and each hand metric."""
    delta, metrics, _ = ours
    expected, expected_metrics, _ = theirs
    element, norm = TOLERANCE[dtype]
    largest = max(float(d.abs().max()) for d in expected.values())
    assert largest > 1e-3  # the update is not trivially zero
    for name in expected:
        torch.testing.assert_close(delta[name], expected[name], rtol=0, atol=element * largest, msg=name)
    for name, value in expected_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5 if dtype == "float32" else 2e-2, abs=1e-6), name


def group_relative(rewards: list[float]) -> list[float]:
    """GRPO's advantage for groups of two: (r - mean) / (Bessel std + 1e-6); each group is (+a, -a)."""
    out = []
    for first, second in zip(rewards[::2], rewards[1::2]):
        a = (first - second) / 2 / (abs(first - second) / math.sqrt(2) + 1e-6)
        out += [a, -a]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_trains_the_model_tokens_alone(tiny_model_dir, dtype):
    """GRPO with KL in the loss and the entropy bonus, one update: the same weights and metrics as the hand-built loss
    over model tokens (the environment's tokens still in context)."""
    learner, hand = build(tiny_model_dir, dtype), build(tiny_model_dir, dtype)
    batch = episodes(learner)
    width = pad_sequences(PROMPTS, EPISODES).response_mask.shape[1]
    per_row = group_relative(REWARDS)
    advantages = at_model_tokens(PROMPTS, MODEL_MASKS, width, [[a] * len(r) for a, r in zip(per_row, EPISODES)])
    ours = update(learner, batch)
    assert_hand_update(ours, hand_update(hand, batch, advantages), dtype)
    # The policy loss over model tokens: -mean A = -(3a - 3a - 3a + 2a) / 11 (a = 0.7071), not over all 16 tokens.
    assert ours[1]["loss/policy"] == pytest.approx(per_row[0] / 11, rel=1e-5)
    # |behaviour - pi_old| is 0.01 on the model tokens of rows 0, 2 and 3 (3 + 3 + 2), 0 on row 1's: 0.08 / 11.
    assert ours[1]["logprob/mismatch"] == pytest.approx(0.08 / 11, abs=1e-6 if dtype == "float32" else 1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gae_chains_turns_over_the_environments_tokens_and_the_value_model_learns_model_tokens_only(tiny_model_dir,
                                                                                                  dtype):
    """PPO: the new value head starts at V = 0, so with gamma 0.9 and lambda 0.8 GAE on a row's n model tokens gives
    A_k = R_k = (0.72)^(n-1-k) r at its k-th model token (the outcome on the last model token, the discount counted
    in model tokens, across the environment's); the policy takes A whitened over the batch's model tokens, the value
    model regresses on R at model tokens only."""
    settings = dict(advantage="gae", gamma=0.9, lam=0.8)
    learner, hand = build(tiny_model_dir, dtype, critic=True, **settings), build(tiny_model_dir, dtype, critic=True,
                                                                                 **settings)
    batch = episodes(learner)
    width = pad_sequences(PROMPTS, EPISODES).response_mask.shape[1]
    per_token = []
    for reward, mask in zip(REWARDS, MODEL_MASKS):
        n, k = sum(mask), 0
        row = []
        for m in mask:
            row.append(0.72 ** (n - 1 - k) * reward if m else 0.0)
            k += m
        per_token.append(row)
    returns = at_model_tokens(PROMPTS, MODEL_MASKS, width, per_token)
    model = at_model_tokens(PROMPTS, MODEL_MASKS, width).bool()
    whitened = torch.zeros_like(returns)
    whitened[model] = (returns[model] - returns[model].mean()) / (returns[model].std() + 1e-8)  # Bessel std
    ours = update(learner, batch)
    assert_hand_update(ours, hand_update(hand, batch, whitened, returns), dtype)
    assert any(name.startswith("critic.") and d.abs().max() > 1e-3 for name, d in ours[0].items())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("settings", [
    # one update: pi_old, the mismatch and a sequence-level correction from the training forward
    dict(rollout_correction="tis", rollout_correction_level="sequence", rollout_correction_cap=1.025),
    # the general path: a pass for pi_old, the KL in the reward, two minibatches, a per-token masked correction
    dict(num_minibatches=2, kl_coef=0.0, kl_reward_coef=0.1, advantage="rloo", rollout_correction="mis",
         rollout_correction_cap=1.005),
    dict(num_minibatches=2, advantage="gae", critic=True),
    dict(advantage="reinforce", baseline="group_mean", policy_loss="gspo", loss_agg="seq-mean-token-mean"),
], ids=["tis-sequence", "kl-in-reward-mis", "gae", "reinforce-gspo"])
def test_what_lies_at_the_environments_positions_changes_nothing(tiny_model_dir, dtype, settings):
    """Garbage behaviour and reference logprobs at the environment's tokens (a sampler's -30, a reference's -60, far
    outside any cap): the same weights and the same metrics, bit for bit."""
    learners = [build(tiny_model_dir, dtype, **settings) for _ in range(2)]
    clean = update(learners[0], episodes(learners[0]))
    garbage = update(learners[1], episodes(learners[1], env_behavior=-30.0, env_ref=-60.0))
    assert clean[1] == garbage[1]
    for name in clean[0]:
        assert torch.equal(clean[0][name], garbage[0][name]), name
    assert max(float(d.abs().max()) for d in clean[0].values()) > 1e-3
    if "rollout_correction_cap" in settings:  # the correction is at work on model tokens: it bites on some
        name = "capped_fraction" if settings["rollout_correction"] == "tis" else "masked_fraction"
        assert 0 < clean[1][f"rollout_correction/{name}"] < 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("settings", [{}, dict(num_minibatches=2, kl_reward_coef=0.1, advantage="gae", critic=True)],
                         ids=["grpo-one-update", "gae-kl-in-reward"])
def test_all_ones_model_masks_are_no_masks_bit_for_bit(tiny_model_dir, dtype, settings):
    """Lists of ones, or packed rows of ones as Ray delivers them: the update and metrics of no masks at all."""
    ones = [[1.0] * len(r) for r in RESPONSES]
    packed = pickle.loads(pickle.dumps(Rows(np.ones(len(r), np.float32) for r in RESPONSES)))
    results = []
    for masks in (None, ones, packed):
        learner = build(tiny_model_dir, dtype, **settings)
        batch = episodes(learner, responses=RESPONSES, masks=ones)
        batch.model_masks = masks
        results.append(update(learner, batch))
    (plain, plain_metrics, _), *others = results
    for delta, metrics, _ in others:
        assert metrics == plain_metrics
        for name in plain:
            assert torch.equal(delta[name], plain[name]), name


def test_packed_model_masks_train_like_lists(tiny_model_dir):
    """What the driver sends (`Rows` of the rollouts' uint8 masks, one flat array across Ray) trains exactly like
    lists of floats."""
    results = []
    for masks in (MODEL_MASKS, pickle.loads(pickle.dumps(Rows(np.asarray(m, np.uint8) for m in MODEL_MASKS)))):
        learner = build(tiny_model_dir)
        batch = episodes(learner)
        batch.model_masks = masks
        results.append(update(learner, batch))
    assert results[0][1] == results[1][1]
    assert all(torch.equal(results[0][0][name], results[1][0][name]) for name in results[0][0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_ending_on_the_environments_tokens_end_at_the_model_token_before_them(tiny_model_dir, dtype):
    """Process supervision: a step end (and its reward) on an environment token counts at the last model token
    before it: the same update as the step ends placed there. Row 3's last token is the environment's: its
    (automatic) last step end and the outcome go to its last model token."""
    def steps(ends: list[list[int]], rewards: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
        dense = [([0.0] * len(r), [0.0] * len(r)) for r in EPISODES]
        for (values, marks), row_ends, row_rewards in zip(dense, ends, rewards):
            for end, reward in zip(row_ends, row_rewards):
                values[end], marks[end] = values[end] + reward, 1.0
        return [d[0] for d in dense], [d[1] for d in dense]

    rewards = [[1.0, 0.0], [0.0, 0.5], [1.0, 0.0], [0.5, 0.0]]
    on_env = steps([[3, 4], [1, 2], [2, 4], [1, 2]], rewards)  # rows 0, 2: the first step ends on the environment's
    on_model = steps([[1, 4], [1, 2], [0, 4], [1, 1]], rewards)  # row 3: both steps end at token 1 (merged)
    results = []
    for step_rewards, step_ends in (on_env, on_model):
        learner = build(tiny_model_dir, dtype)
        batch = episodes(learner, rewards=[0.0] * 4)
        batch.step_rewards, batch.step_ends = step_rewards, step_ends
        results.append(update(learner, batch))
    assert results[0][1] == results[1][1] and results[0][1]["advantage/mean_abs"] > 0.1
    assert all(torch.equal(results[0][0][name], results[1][0][name]) for name in results[0][0])


@functools.cache
def eight_rows(model_dir, dtype: str) -> TrainBatch:
    """test_micro_batching's 8 rows with environment segments, its behaviour (shifted; 0 at the environment's
    tokens) and reference logprobs. Read-only: every learner gets the same batch."""
    behavior, ref = eight.inputs(model_dir, dtype)
    behavior = [[lp if m else 0.0 for lp, m in zip(row, mask)] for row, mask in zip(behavior, EIGHT_MASKS)]
    return TrainBatch(eight.PROMPTS, eight.RESPONSES, behavior, eight.REWARDS, 2, ref, model_masks=EIGHT_MASKS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_token_budget_and_micro_batch_size_passes_make_the_one_pass_update_in_every_mode(tiny_model_dir, dtype,
                                                                                         mode):
    for policy_loss in (["ppo", "gspo"] if mode == "seq-mean-token-mean" else ["ppo"]):
        for minibatches in (1, 2):  # one update (pi_old from the training forward), and the general path
            settings = dict(loss_agg=mode, policy_loss=policy_loss, num_minibatches=minibatches)
            whole = build(tiny_model_dir, dtype, max_tokens_per_micro_batch=None, **settings)
            split = build(tiny_model_dir, dtype, max_tokens_per_micro_batch=BUDGET, micro_batch_size=1, **settings)
            budget = build(tiny_model_dir, dtype, max_tokens_per_micro_batch=BUDGET, micro_batch_size=2, **settings)
            expected = update(whole, eight_rows(tiny_model_dir, dtype))
            assert_same_update(update(split, eight_rows(tiny_model_dir, dtype)), expected, dtype)
            assert_same_update(update(budget, eight_rows(tiny_model_dir, dtype)), expected, dtype)


class RankWithoutGroup(DataParallel):
    """Rank `rank` of `world_size`, without a process group: it runs its own share of every pass (the real
    `micro_batches`, weighted against the whole minibatch) and leaves the sums over ranks (ddp's all-reduce of
    gradients and metrics) to the test; the rows every rank computes for pi_old are all computed here."""

    def compute_rows(self, batch, compute, batching, lengths=None):
        return DataParallel().compute_rows(batch, compute, batching, lengths)

    def all_reduce(self, tensor):
        return tensor

    def sum_metrics(self, totals):
        return totals

    def reduce_gradients(self, modules):
        return None


SUMMED = ("loss/policy", "kl/mean", "entropy/mean", "clip_fraction", "ratio_mean", "approx_kl")  # each rank's share


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_ranks_shares_sum_to_the_one_rank_update_in_every_mode(tiny_model_dir, dtype, mode):
    """2 and 3 ranks: the sum of the ranks' updates (one SGD step, linear in the gradient) and of their metrics is
    the one rank's update, with the environment's tokens counted nowhere; pi_old from the training forward, or from
    a pass of its own."""
    settings = dict(loss_agg=mode, max_tokens_per_micro_batch=BUDGET)
    for world_size, single_update in ((2, True), (3, True), (3, False)):
        one = build(tiny_model_dir, dtype, **settings)
        one.single_update = single_update
        delta, metrics, _ = update(one, eight_rows(tiny_model_dir, dtype))
        ranks = []
        for rank in range(world_size):
            learner = build(tiny_model_dir, dtype, **settings)
            learner.dp, learner.single_update = RankWithoutGroup(rank, world_size), single_update
            ranks.append(update(learner, eight_rows(tiny_model_dir, dtype)))
        summed = {name: sum(r[0][name] for r in ranks) for name in delta}
        names = SUMMED + ("logprob/mismatch",) * single_update  # else measured once, over the whole batch
        total = {name: sum(r[1][name] for r in ranks) for name in names}
        assert_same_update((summed, total, 0), (delta, {name: metrics[name] for name in names}, 0), dtype)
