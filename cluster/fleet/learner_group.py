"""The learner as a group of `learner.num_ranks` Ray actors, one data-parallel rank each, called as one learner.

Owns: starting the rank actors with the per-rank Ray options the caller gives (placement is the caller's), forming
their torch.distributed group (rank 0's node address and a free port; rendezvous and collectives bounded by
`timeouts.train`), and calling the ranks together under a deadline: every rank gets the whole batch (one object in
the object store) and the same calls in the same order (they run collectives); the first rank that fails ends the
call. With one rank the calls go to the one actor as they are (no process group, no `ray.put`).
Does not own: placement groups or bundles (cluster/fleet/placement.py), what a step does (cluster/run/trainer.py), or
the data-parallel arithmetic (learner/distributed.py). Weight transports and the pool's fingerprint check talk to
`rank0` directly: rank 0 alone serves the `WeightPublisher` methods (sync/publisher.py).
`Updates`: the learner as a step sees it (the train batch, updates sent then waited for within `timeouts.train`, the
weights version they produce, checked; a `gate` run before each: the rollouts' checks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from rewards.steps import token_step_rewards
from sync.calls import RunError, call_all, get, values, wait_all

if TYPE_CHECKING:
    from cluster.config import RunConfig
    from cluster.run_sections import TimeoutConfig
    from learner.config import CriticConfig, LearnerConfig
    from learner.learner import TrainBatch


class LearnerGroup:
    """Handles to every rank's actor; each method calls the ranks it needs and waits within its deadline."""

    def __init__(self, ranks: list[Any], timeouts: TimeoutConfig):
        self.ranks = ranks
        self.timeouts = timeouts

    @property
    def rank0(self) -> Any:
        """Rank 0's actor: it writes checkpoints and serves the whole weights for sync."""
        return self.ranks[0]

    @property
    def names(self) -> list[str]:
        """How errors name each rank ("learner" alone with one rank)."""
        return ["learner"] if len(self.ranks) == 1 else [f"learner rank {i}" for i in range(len(self.ranks))]

    def connect(self) -> None:
        """Wait for every rank's actor to start (`timeouts.start`) and, with several ranks, form their group."""
        self._call_all("__ray_ready__", (), self.timeouts.start, "start")
        if len(self.ranks) > 1:
            host, port = get([self.rank0.__ray_call__.remote(_open_group, self.timeouts.train)], self.timeouts.start,
                             self.names[:1], "start")[0]
            self._call_all("join_process_group", (host, port, self.timeouts.train), self.timeouts.start, "start")

    def train_step(self, batch: TrainBatch, ref_logprobs: Any = None) -> dict[str, float]:
        """One update over every rank; rank 0's metrics (the same on every rank: they are summed over ranks), with
        `weights/version`, the version it produced. `ref_logprobs`: the ref of the reference's flat logprobs, which
        Ray hands each rank without the driver reading them."""
        return self.finish(self.submit_train(batch, ref_logprobs), self.timeouts.train, "train")[0]

    def submit_train(self, batch: TrainBatch, ref_logprobs: Any = None, teacher_logprobs: Any = None) -> list[Any]:
        """`train_step` sent to every rank and not waited for (asynchronous training generates meanwhile): the refs
        for `finish`."""
        shared = batch if len(self.ranks) == 1 else ray.put(batch)  # one copy, each rank reads all of it
        return self.submit("train_step", (shared, ref_logprobs, teacher_logprobs))

    def compute_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                         temperature: float | None = None) -> list[list[float]]:
        """The learner's logprobs of the given sequences (every rank computes its share; rank 0's answer), at the
        sampling temperature unless `temperature` is given."""
        return self._call_all("compute_logprobs", (prompt_ids, response_ids, temperature), self.timeouts.sync,
                              "sync")[0]

    def submit(self, method: str, args: tuple) -> list[Any]:
        """`method(*args)` on every rank, not waited for: the refs, for `finish` (every rank's, so that a rank's
        failure is not lost)."""
        return [getattr(rank, method).remote(*args) for rank in self.ranks]

    def finish(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        """The results of a `submit`, in rank order, within `timeout` seconds from now; RunError naming the rank
        that failed or missed it."""
        return values(wait_all(refs, timeout, what, stop_on_failure=True), self.names, what)

    def save_checkpoint(self, directory: str) -> None:
        """Every rank joins; rank 0 writes the learner's part of the checkpoint into `directory`."""
        self._call_all("save_checkpoint", (directory,), self.timeouts.train, "train")

    def load_checkpoint(self, directory: str) -> int:
        """Every rank loads `directory`; returns the weights version of the restored policy."""
        versions = self._call_all("load_checkpoint", (directory,), self.timeouts.train, "train")
        if len(set(versions)) != 1:
            raise RunError(f"learner ranks restored different weights versions {versions} from {directory}")
        return versions[0]

    def count_buckets(self, bucket_bytes: int) -> int:
        return get([self.rank0.count_buckets.remote(bucket_bytes)], self.timeouts.sync, self.names[:1], "sync")[0]

    def export_weight_buckets(self, bucket_bytes: int, num_buckets: int) -> list[Any]:
        """Rank 0 exports its whole weights: one object ref per bucket (`num_buckets` from `count_buckets`)."""
        refs = self.rank0.export_weight_buckets.options(num_returns=num_buckets).remote(bucket_bytes)
        return refs if num_buckets > 1 else [refs]

    def kill(self) -> None:
        for actor in self.ranks:
            ray.kill(actor)

    def _call_all(self, method: str, args: tuple, timeout: float, what: str) -> list[Any]:
        """`method(*args)` on every rank; their results in rank order. RunError (naming the rank) on the first
        failure, or when a rank misses the deadline."""
        return values(call_all(self.ranks, method, args, timeout, what, stop_on_failure=True), self.names, what)


def launch_learner_group(rank_options: list[dict[str, Any]], model_path: str, config: LearnerConfig, *,
                         dtype: str, temperature: float, seed: int, critic: CriticConfig | None,
                         norm_length: int | None, timeouts: TimeoutConfig,
                         learner_cls: type | None = None) -> LearnerGroup:
    """Create one actor per rank with `rank_options[rank]` (Ray actor options: resources, scheduling strategy,
    runtime env); the models start loading. Call `connect` (or use `start_learner_group`) before anything else.
    `learner_cls` replaces `Learner` (a subclass with injected faults, in the tests)."""
    from learner.learner import Learner

    if len(rank_options) != config.num_ranks:
        raise ValueError(f"{len(rank_options)} sets of actor options for learner.num_ranks={config.num_ranks}")
    remote_cls = ray.remote(learner_cls or Learner)
    ranks = [remote_cls.options(**options).remote(*rank_args(model_path, config, rank, dtype=dtype,
                                                             temperature=temperature, seed=seed, critic=critic,
                                                             norm_length=norm_length))
             for rank, options in enumerate(rank_options)]
    return LearnerGroup(ranks, timeouts)


def rank_args(model_path: str, config: LearnerConfig, rank: int, *, dtype: str, temperature: float, seed: int,
              critic: CriticConfig | None, norm_length: int | None) -> tuple:
    """A rank's `Learner` constructor arguments."""
    return model_path, config, dtype, temperature, seed, critic, norm_length, rank


def start_learner_group(rank_options: list[dict[str, Any]], model_path: str, config: LearnerConfig,
                        **kwargs: Any) -> LearnerGroup:
    """`launch_learner_group`, then `connect`; kills the ranks if either fails."""
    group = launch_learner_group(rank_options, model_path, config, **kwargs)
    try:
        group.connect()
    except BaseException:
        group.kill()
        raise
    return group


def _open_group(learner: Any, timeout_s: float) -> tuple[str, int]:
    """Run inside rank 0's actor (`__ray_call__`): its node's address and the port its group's rendezvous now
    listens on (the OS chose it, so no other process holds it)."""
    host = ray.util.get_node_ip_address()
    return host, learner.open_process_group(host, timeout_s)


@dataclass
class Update:
    """One update sent to the learner (`Updates.submit`)."""

    refs: list[Any]  # every rank's
    submitted: float  # time.monotonic() when it was sent
    done: list[float] = field(default_factory=list)  # gets the time.monotonic() when it was done


class Updates:
    """`version`: the weights version the learner's last finished update produced; `updated`: when it was done."""

    def __init__(self, config: RunConfig, learner_group: Any, gate: Callable[[], None]):
        self.config = config
        self.learner_group = learner_group
        self.gate = gate
        self.version = 0
        self.updated: float | None = None  # time.monotonic() when the learner's last update was done

    def restored(self, version: int) -> None:
        """The learner was restored from a checkpoint at weights version `version`."""
        self.version = version

    def submit(self, rollouts: list[Any], rewards: list[float], reference: Any, teacher: Any,
               timings: dict[str, float]) -> Update:
        """Send the update to the learner without waiting (`finish` waits), and record how long the learner waited
        since its last update was done (`time/learner_wait`)."""
        from learner.learner import TrainBatch
        from learner.passes.sequences import Rows

        self.gate()
        submitted = time.monotonic()
        timings["time/learner_wait"] = submitted - self.updated if self.updated is not None else 0.0
        batch = TrainBatch(prompt_ids=Rows(r.prompt_ids for r in rollouts),
                           response_ids=Rows(r.response_ids for r in rollouts),
                           behavior_logprobs=Rows(r.behavior_logprobs for r in rollouts), rewards=rewards,
                           group_size=self.config.rollout.group_size)  # Rows: packed across Ray
        if any(r.model_mask is not None for r in rollouts):  # multi-turn episodes: train on the model's tokens only
            batch.model_masks = Rows(np.ones(len(r.response_ids), np.uint8) if r.model_mask is None
                                     else np.asarray(r.model_mask, np.uint8) for r in rollouts)
        if self.config.scores_steps:
            dense = [token_step_rewards(r.step_ends, r.step_rewards, len(r.response_ids)) for r in rollouts]
            batch.step_rewards, batch.step_ends = Rows(d[0] for d in dense), Rows(d[1] for d in dense)
        update = Update(self.learner_group.submit_train(batch, reference, teacher), submitted)
        update.refs[0].future().add_done_callback(lambda _: update.done.append(time.monotonic()))
        return update

    def finish(self, update: Update, step: int) -> dict[str, float]:
        """Wait for `update` (`timeouts.train` from its submission): the learner's metrics; `version` becomes the
        version it reports it produced, which must be the next one, `updated` when it was done."""
        remaining = self.config.timeouts.train - (time.monotonic() - update.submitted)
        metrics = self.learner_group.finish(update.refs, max(0.0, remaining), "train")[0]
        self.updated = update.done[0] if update.done else time.monotonic()
        produced = int(metrics["weights/version"])
        if produced != self.version + 1:
            raise RunError(f"the learner reports weights version {produced} after step {step}, expected "
                           f"{self.version + 1}: its updates and the driver's steps are out of step")
        self.version = produced
        return metrics
