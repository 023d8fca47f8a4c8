"""The data-parallel learner on real Ray actors with gloo on CPU: 2 ranks on a batch make the update of 1 rank on
the same batch (ddp and fsdp2; GRPO with KL and entropy, and PPO's GAE with the value model), report its metrics,
skip a non-finite update together, and resume bitwise from their own checkpoint, which one rank can load too.

The two-rank tests run their groups in the same two actor processes (`RankPool`): each test re-initialises them as
its ranks and forms a new process group, as the session's fleet pool does for runs (tests/fleets.py); a test that
fails, or leaves a rank inside a collective, stops them and the next starts new ones.

A run through the driver with two ranks (placement reserves a bundle per rank, the probe asks every rank, rank 0
exports and checkpoints) is tests/cluster/test_async.py's data-parallel run."""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import pytest
import ray
import torch

from cluster.fleet.learner_group import LearnerGroup, rank_args, start_learner_group
from cluster.run_sections import TimeoutConfig
from learner.batch import TrainBatch
from learner.config import CriticConfig, LearnerConfig
from learner.learner import Learner
from sync.calls import RunError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # SgdLearner travels to the rank actors by value

pytestmark = pytest.mark.slow

# Three groups of two, unequal lengths: each rank's share of a minibatch of 3 is 2 rows or 1 (uneven shares, and
# micro-batches that differ from one rank's), so the global weighting across ranks is exercised.
PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 12, 4, 15]] * 2 + [[9, 12, 9, 15]] * 2
RESPONSES = [[12, 2, 1], [4, 4, 1], [5, 1], [9, 1], [13, 1], [3, 12, 2, 1]]
REWARDS = ([1.0, 0.0, 0.5, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 0.5, 0.0, 1.0, 1.0, 0.0])
# Tolerance, float32: ranks change only the order of float32 sums (gradients per rank then across ranks; fsdp2 also
# takes the clip norm as a sum of per-shard sums), ~1 ulp per gradient element. After 3 SGD steps of lr 0.1 the
# weights agree to within 1 ulp of their size: measured max |diff| 0 for ddp (here its row partition matches one
# rank's micro-batches) and 6e-8 for fsdp2, on layer-norm weights of ~1 (ulp 6e-8 < 1e-6 relative). The bound
# |diff| <= 1e-6 |w| + 2e-7 is ~3x above that, and a real mistake is far outside it (averaging instead of summing
# gradients halves them: caught at once; a lost share or wrong normaliser moves weights by ~1e-3).
RTOL, ATOL = 1e-6, 2e-7

CONFIGS = {
    # seq-mean-token-mean: a sequence weighting that a per-rank normaliser would get wrong; KL in the loss, entropy
    # bonus, and a clip threshold below the gradient norm, so the clip needs the global norm.
    "grpo": dict(advantage="grpo", loss_agg="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01, max_grad_norm=0.5),
    "gae": dict(advantage="gae", kl_coef=0.0, lam=0.95),
    # One update per batch: old logprobs and the mismatch metrics come from the training forward, each rank its
    # share, summed; passes cut by a token budget (rows of 5 to 10 tokens: one or two rows per pass).
    "grpo_one_update": dict(advantage="grpo", loss_agg="token-mean", kl_coef=0.1, num_minibatches=1,
                            micro_batch_size=None, max_tokens_per_micro_batch=16),
}


class SgdLearner(Learner):
    """SGD with momentum for the policy and the value model: linear in the gradient, so float noise stays noise
    (Adam's first steps are sign-like and turn noise in near-zero gradient elements into lr-sized differences),
    and the momentum buffers are optimizer state for the checkpoint to carry."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.critic:
            self.critic._make_optimizer = lambda: _use_sgd(self.critic, self.critic.model, self.critic.config.lr)
            self.critic._make_optimizer()  # and again after fully_shard, in join_process_group

    def _make_optimizer(self) -> None:
        _use_sgd(self, self.model, self.config.lr)

    def fail_on_rank_1(self) -> None:
        """Rank 1 raises while rank 0 waits in a collective, like a rank that hits a bug mid-step."""
        if self.dp.rank == 1:
            raise RuntimeError("injected failure")
        self.dp.all_reduce(torch.zeros(1))


def reinit_rank(instance, *args, **kwargs) -> None:
    """Run inside a rank's actor (`__ray_call__`): drop its learner, leave its process group, and run the
    constructor again with these arguments, as if the process had just started it (`connect` then joins a new
    group)."""
    import gc

    import torch.distributed as dist

    instance.__dict__.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    type(instance).__init__(instance, *args, **kwargs)


class RankPool:
    """Two `SgdLearner` rank actors kept between this module's tests: `group` gives them to a test as its ranks,
    re-initialised with its arguments and joined in a new process group; `discard` stops them."""

    OPTIONS = [{"num_cpus": 0.5}] * 2

    def __init__(self) -> None:
        self.ranks: list | None = None

    def group(self, model_path: str, config: LearnerConfig, timeouts: TimeoutConfig, **kwargs) -> LearnerGroup:
        if self.ranks is None:
            group = start_learner_group(self.OPTIONS, model_path, config, learner_cls=SgdLearner, timeouts=timeouts,
                                        **kwargs)
            self.ranks = group.ranks
            return group
        try:
            ray.get([rank.__ray_call__.remote(reinit_rank, *rank_args(model_path, config, i, **kwargs))
                     for i, rank in enumerate(self.ranks)], timeout=timeouts.start)
            group = LearnerGroup(self.ranks, timeouts)
            group.connect()
        except BaseException:
            self.discard()
            raise
        return group

    def discard(self) -> None:
        for rank in self.ranks or []:
            ray.kill(rank)
        self.ranks = None


@pytest.fixture(scope="module")
def rank_pool(ray_local):
    pool = RankPool()
    yield pool
    pool.discard()


def _use_sgd(owner, model, lr: float) -> None:
    owner.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    owner.scheduler = torch.optim.lr_scheduler.LambdaLR(owner.optimizer, lambda n: 1.0)


def learner_config(algo: str, **overrides) -> LearnerConfig:
    return LearnerConfig(**{"lr": 0.1, "warmup_steps": 0, "num_minibatches": 2, "micro_batch_size": 2,
                            "num_threads": 1, **CONFIGS[algo], **overrides})


def critic_config(algo: str) -> CriticConfig | None:
    return CriticConfig(enabled=True, lr=0.1) if algo == "gae" else None


def batch(behavior, rewards) -> TrainBatch:
    ref = [[lp - 0.1 * (i % 3) for lp in row] for i, row in enumerate(behavior)]  # log pi - log pi_ref != 0
    return TrainBatch(PROMPTS, RESPONSES, behavior, list(rewards), 2, ref)


def weights(buckets) -> dict[str, torch.Tensor]:
    return {name: array if isinstance(array, torch.Tensor) else torch.as_tensor(np.array(array))
            for bucket in buckets for name, array in bucket}


def assert_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], **tolerance) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], msg=name, **(tolerance or {"rtol": RTOL, "atol": ATOL}))


def learned(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("memory/")}  # per process, not the update's


@pytest.mark.parametrize("algo", ["grpo", "gae", "grpo_one_update"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_make_the_one_rank_update(rank_pool, tiny_model_dir, tmp_path, strategy, algo):
    config = learner_config(algo, num_ranks=2, strategy=strategy)
    group = rank_pool.group(str(tiny_model_dir), config, TimeoutConfig(start=120, train=120, sync=60),
                            dtype="float32", temperature=1.0, seed=0, critic=critic_config(algo), norm_length=4)
    reusable = False
    try:
        one = SgdLearner(str(tiny_model_dir), learner_config(algo), critic=critic_config(algo), norm_length=4)
        initial = {name: tensor.clone() for name, tensor in one.policy_state_dict().items()}
        behavior = one.compute_logprobs(PROMPTS, RESPONSES)
        for ours, theirs in zip(group.compute_logprobs(PROMPTS, RESPONSES), behavior):
            assert ours == pytest.approx(theirs, rel=RTOL, abs=ATOL)

        for rewards in REWARDS[:2]:
            expected = learned(one.train_step(batch(behavior, rewards)))
            got = learned(group.train_step(batch(behavior, rewards)))
            assert got.keys() == expected.keys()
            for name in expected:  # metrics are sums over ranks of the same terms: as close as the weights
                assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
        assert got["train/skipped_updates"] == 0 and got["grad_norm"] > 0
        exported = weights(ray.get(group.rank0.export_weights.remote(2**30)))
        assert_close(exported, one.policy_state_dict())
        assert not all(torch.allclose(initial[n], exported[n], rtol=1e-4, atol=1e-5) for n in exported)  # it learned

        # The checkpoint: rank 0 writes whole tensors, in the layout one rank writes; resuming is bitwise.
        group.save_checkpoint(str(tmp_path))
        if algo == "gae":
            from safetensors.torch import load_file

            assert_close(load_file(tmp_path / "critic" / "model.safetensors"),
                         {k: v for k, v in one.critic.model.state_dict().items()})
        third = batch(behavior, REWARDS[2])
        group.train_step(third)
        after_third = weights(ray.get(group.rank0.export_weights.remote(2**30)))
        assert group.load_checkpoint(str(tmp_path)) == 2
        assert weights(ray.get(group.rank0.export_weights.remote(2**30))).keys() == exported.keys()
        group.train_step(third)
        resumed = weights(ray.get(group.rank0.export_weights.remote(2**30)))
        for name in after_third:
            assert torch.equal(resumed[name], after_third[name]), name
        restored = SgdLearner(str(tiny_model_dir), learner_config(algo), critic=critic_config(algo), norm_length=4)
        assert restored.load_checkpoint(str(tmp_path)) == 2  # one rank loads the two ranks' checkpoint
        restored.train_step(third)
        one.train_step(third)
        assert_close(weights(restored.export_weights(2**30)), after_third)
        assert_close(after_third, one.policy_state_dict())

        # A non-finite update. grpo: one reference logprob is NaN, so only the rank holding that row gets a
        # non-finite loss, in one minibatch; every rank must skip that update and take the other. gae: a NaN reward
        # reaches every row through the batch-wide whitening: every update is skipped.
        bad = batch(behavior, REWARDS[0])
        if algo != "gae":
            bad.ref_logprobs[0][0] = math.nan
        else:
            bad.rewards[0] = math.nan
        expected = one.train_step(bad)["train/skipped_updates"]
        assert group.train_step(bad)["train/skipped_updates"] == expected == (2 if algo == "gae" else 1)
        per_rank = [weights(b) for b in ray.get([r.export_weights.remote(2**30) for r in group.ranks])]
        assert_close(per_rank[0], one.policy_state_dict())  # fsdp2: rank 0's gather holds every rank's shard
        if strategy == "ddp":  # replicas: every rank made the same decision, bitwise
            for name in per_rank[0]:
                assert torch.equal(per_rank[1][name], per_rank[0][name]), name
        reusable = True
    finally:
        if not reusable:
            rank_pool.discard()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_keep_float32_master_weights_under_bfloat16_compute(rank_pool, tiny_model_dir, tmp_path, strategy):
    """model.dtype=bfloat16 with float32 master weights on two ranks: parameters (sharded or not) stay float32, the
    update is one rank's up to bfloat16 compute noise (the ranks' micro-batches are padded differently), rank 0
    exports bfloat16, and the group resumes bitwise from its own checkpoint."""
    config = learner_config("grpo", num_ranks=2, strategy=strategy)
    group = rank_pool.group(str(tiny_model_dir), config, TimeoutConfig(start=120, train=120, sync=60),
                            dtype="bfloat16", temperature=1.0, seed=0, critic=None, norm_length=4)
    reusable = False
    try:
        one = SgdLearner(str(tiny_model_dir), learner_config("grpo"), dtype="bfloat16", norm_length=4)
        initial = {name: tensor.clone() for name, tensor in one.policy_state_dict().items()}
        behavior = one.compute_logprobs(PROMPTS, RESPONSES)
        for rewards in REWARDS[:2]:
            one.train_step(batch(behavior, rewards))
            group.train_step(batch(behavior, rewards))
        masters = ray.get([r.__ray_call__.remote(lambda self: {n: t.dtype for n, t in self.model.state_dict().items()})
                           for r in group.ranks])
        assert all(set(m.values()) == {torch.float32} for m in masters)
        master = ray.get(group.rank0.__ray_call__.remote(lambda self: dict(self.policy_state_dict())))
        moved = max(float((master[n] - initial[n]).abs().max()) for n in master)
        assert_close(master, one.policy_state_dict(), rtol=0, atol=0.05 * moved)  # noise, not a wrong update
        exported = weights(ray.get(group.rank0.export_weights.remote(2**30)))
        assert {t.dtype for t in exported.values()} == {torch.bfloat16}
        assert all(torch.equal(exported[n], master[n].to(torch.bfloat16)) for n in exported)

        group.save_checkpoint(str(tmp_path))
        third = batch(behavior, REWARDS[2])
        group.train_step(third)
        after_third = ray.get(group.rank0.__ray_call__.remote(lambda self: dict(self.policy_state_dict())))
        assert group.load_checkpoint(str(tmp_path)) == 2
        group.train_step(third)
        resumed = ray.get(group.rank0.__ray_call__.remote(lambda self: dict(self.policy_state_dict())))
        for name in after_third:
            assert torch.equal(resumed[name], after_third[name]), name
        reusable = True
    finally:
        if not reusable:
            rank_pool.discard()


def test_a_failing_rank_ends_the_call_at_once(rank_pool, tiny_model_dir):
    """The group reports rank 1's error as soon as it happens, not when rank 0's collective times out (120 s). Last
    of the two-rank tests: rank 0 is left inside its collective, so the ranks are stopped."""
    group = rank_pool.group(str(tiny_model_dir), learner_config("grpo", num_ranks=2, strategy="ddp"),
                            TimeoutConfig(start=120, train=120, sync=60), dtype="float32", temperature=1.0, seed=0,
                            critic=None, norm_length=4)
    try:
        started = time.monotonic()
        with pytest.raises(RunError, match="learner rank 1 failed during 'train': RuntimeError: injected failure"):
            group._call_all("fail_on_rank_1", (), 100, "train")
        assert time.monotonic() - started < 30
    finally:
        rank_pool.discard()


def test_one_rank_group_is_the_single_learner(ray_local, tiny_model_dir):
    """num_ranks=1: no process group, the same calls as the single learner actor: bitwise the same update."""
    config = learner_config("grpo", num_ranks=1)
    group = start_learner_group([{"num_cpus": 0.5}], str(tiny_model_dir), config, dtype="float32", temperature=1.0,
                                seed=0, critic=None, norm_length=4, timeouts=TimeoutConfig(start=120, train=120))
    try:
        assert group.names == ["learner"]
        one = Learner(str(tiny_model_dir), config, seed=0, norm_length=4)  # Adam, as configured
        behavior = one.compute_logprobs(PROMPTS, RESPONSES)
        assert group.compute_logprobs(PROMPTS, RESPONSES) == behavior
        step = batch(behavior, REWARDS[0])
        assert learned(group.train_step(step)) == learned(one.train_step(step))
        assert group.count_buckets(2**30) == 1
        exported = weights([ray.get(group.export_weight_buckets(2**30, 1)[0])])  # one bucket travels bare
        for name, tensor in one.policy_state_dict().items():
            assert torch.equal(exported[name], tensor), name
    finally:
        group.kill()

