"""The driver: one training run, step by step, over the actors that `cluster.fleet.placement` placed.

Owns: `Trainer.step` (docs/architecture.md, one step: take `relay scale` requests -> sample prompts -> generate ->
score -> reference logprobs -> learn -> sync weights -> record), DAPO's dynamic sampling and overlong shaping of a
step's groups, iterative GRPO's schedule (mixing replayed groups into a batch, fine-tuning reward models with `train`
on a step's completions after its update), writing and restoring checkpoints through the fleet (the replay buffer
and fine-tuned reward models included), and a run from start to end (`run_training`:
checking every input first, starting Ray, the control actor and the fleet, the step loop, cleaning up).
Does not own: the math (learner/), the engines (actors/), placement (cluster/fleet/placement.py), balancing, recovery
and the verified weight sync (cluster/fleet/rollout_pool.py), prompts (cluster/run/data.py), combining rewards
(cluster/run/scoring.py), the replay buffer itself (cluster/run/replay.py), metrics (cluster/run/metrics.py),
checkpoint files (cluster/run/checkpoint.py) or call deadlines (sync/calls.py).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from cluster.config import ConfigError, RunConfig, dump_config
from cluster.demo.task import Problem
from cluster.fleet.control import start_control
from cluster.fleet.placement import (
    RAY_SYSTEM_CONFIG,
    Fleet,
    FleetPool,
    check_reachable,
    node_of,
    start_fleet,
    stop_fleet,
    with_default_threads,
)
from cluster.fleet.reference_refresh import ReferenceRefresh
from cluster.fleet.rollout_pool import Batch, RolloutPool
from cluster.run import checkpoint, resume
from cluster.run.data import sampling_seeds
from cluster.run.metrics import MetricsRecorder, ProgressDisplay, check_logging, dashboard_line
from cluster.run.replay import ReplayBuffer
from cluster.run.scoring import Scorer
from rewards.config import ModelSource
from rewards.shaping import overlong_penalty
from rewards.steps import token_step_rewards
from sync.calls import Later, RunError, get

REWARD_MODELS_DIR = "reward_models"  # a checkpoint's fine-tuned reward models, one directory each

@dataclass
class Tally:
    """A step's scored groups so far, over its generation rounds (`Trainer.add_round`)."""

    sources: Any  # the reward sources' names
    kept: list[tuple[list[Any], list[float]]] = field(default_factory=list)
    uninformative: list[tuple[list[Any], list[float]]] = field(default_factory=list)  # set aside (dynamic sampling)
    # every completion's total reward (outcome, shaped, plus its step rewards), uninformative groups included
    scored: list[float] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    per_source: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        self.per_source = {name: [] for name in self.sources}


@dataclass
class Prepared:
    """Asynchronous training: one step's batch, collected and scored, its reference logprobs asked for."""

    version: int  # the weights version that sampled it
    groups: list[list[Any]]
    rewards: list[float]
    stats: dict[str, Any]
    reference: tuple[Any, Any, float] | None  # `Trainer.submit_reference`
    timings: dict[str, float]  # its time/generate and time/score
    fresh: int  # groups sampled for this step: the first ones of `groups` (replayed groups follow)


@dataclass
class Update:
    """One update sent to the learner (`Trainer.submit_train`)."""

    refs: list[Any]  # every rank's
    submitted: float  # time.monotonic() when it was sent
    done: list[float] = field(default_factory=list)  # gets the time.monotonic() when it was done


def overlaps_reference(config: RunConfig) -> bool:
    """Whether on-policy steps send the update before the reference's logprobs arrive (`learner.overlap_reference`),
    for a config whose thread counts are resolved (`with_default_threads`)."""
    lc, rc = config.learner, config.reference
    if lc.overlap_reference != "auto":
        return lc.overlap_reference
    return not (lc.num_gpus == 0 and rc.num_gpus == 0 and max(lc.num_threads, rc.num_threads) > 1)


class Trainer:
    """Runs steps over a started fleet; each `step` returns that step's metrics record."""

    def __init__(self, config: RunConfig, fleet: Fleet, data: Any, scorer: Scorer, control: Any = None):
        from actors.rollout import SamplingSettings

        self.config = config
        self.fleet = fleet
        self.data = data  # a prompt source from `prepare`: next_batch() -> list[Problem]
        ro = config.rollout
        self.sampling = SamplingSettings(ro.group_size, ro.max_new_tokens, ro.temperature, ro.top_p)
        self.scorer = scorer
        scorer.attach(fleet.reward_models, fleet.launcher.settings.model_path)
        self.rollouts = RolloutPool(config, fleet)
        self.reference_refresh = ReferenceRefresh(config, fleet, self.rollouts)  # `reference.refresh_every`
        dc = config.data
        self.replay = ReplayBuffer(dc.replay_fraction, dc.replay_buffer_size, config.seed, dc.prompts_per_step)
        self.fit_data: dict[int, dict[str, tuple[list, list, list]]] = {}  # step -> reward model -> its examples
        self.weights_version = 0
        self.timings: dict[str, float] = {}
        self.control = control  # the run's RunControl actor (`relay scale`), if any
        self.request = None  # its pending `relay scale` request, asked for after the last step (`publish`)
        # The learner's placement group is fixed for the run: ask Ray for its node once, not in every step.
        self.learner_node = node_of(fleet.placement) if control is not None else None
        self.updated: float | None = None  # time.monotonic() when the learner's last update was done
        self.overlap_reference = overlaps_reference(with_default_threads(config, fleet.launcher.settings.model_path))
        # Asynchronous training (`rollout.max_staleness` = k >= 1): batches in flight and batches ready, by step.
        self.staleness = ro.max_staleness
        self.in_flight: dict[int, tuple[Batch, list[Problem]]] = {}
        self.prepared: dict[int, Prepared] = {}

    def step(self, step: int) -> dict[str, Any]:
        """One step; on-policy, the weights are synced to every rollout worker before the next step samples (loaded
        and probed at the start of its requests) or, at the last step, before it returns. Asynchronous with
        `rollout.max_staleness` >= 1 (`async_step`)."""
        if self.staleness:
            return self.async_step(step)
        self.timings = {"time/generate": 0.0, "time/score": 0.0}
        started = time.perf_counter()
        recovering = self.rollouts.recovery_seconds
        with self.timed("scale"):
            self.apply_scale_request()
        groups, rewards, sampling = self.sample(step)
        groups, rewards = self.replay.mix(step, groups, rewards, self.weights_version, sampling)
        rollouts = [r for group in groups for r in group]
        with self.timed("reference"):
            self.refresh_reference(step, sampling)
            asked = self.submit_reference(rollouts)
            self.rollouts.check_pending()  # the probes of this step's loads, scored by the learner meanwhile
            # Overlapping, the update goes out now with the reference's logprobs on their way (`later`): the learner
            # runs its training forward while the reference computes, and waits for them before its first loss.
            ref_logprobs = self.later(asked) if self.overlap_reference else self.reference_result(asked)
            update = self.submit_train(rollouts, rewards, ref_logprobs)
            if self.overlap_reference:
                self.reference_result(asked)  # its failure or missed deadline is the reference's, as named here
        with self.timed("train"):
            learner_metrics = self.finish_train(update)
        self.fit_reward_models(step, sampling)
        with self.timed("sync"):
            self.sync_weights(now=step == self.config.max_steps)
        self.timings["time/recovery"] = self.rollouts.recovery_seconds - recovering  # inside generate and sync
        self.timings["time/rollout_idle"] = self.rollouts.take_idle()
        sampling.update({"rollout/version": self.weights_version - 1, "async/staleness": 0})
        return self.record(step, rollouts, learner_metrics, self.rollouts.take_gap(), time.perf_counter() - started,
                           sampling)

    def async_step(self, step: int) -> dict[str, Any]:
        """One step of asynchronous training (docs/operations.md): the batch of step t was sampled with weights
        version exactly max(c, t - 1 - k), c the latest step where the pipeline drained (a checkpoint step, or where
        the run or its resume started). While the learner trains on it, the engines sample the next batches (each
        worker loads a new version between its requests), and the driver collects, scores and asks the reference
        for the next one; after the update the next batch goes out, carrying the new weights."""
        self.timings = {}
        started = time.perf_counter()
        recovering = self.rollouts.recovery_seconds
        with self.timed("scale"):
            self.apply_scale_request()
        self.fill(step)
        ready = self.prepared.pop(step, None) or self.prepare(step)
        self.timings.update(ready.timings)  # its generate and score times: overlapped with the last update if early
        with self.timed("reference"):
            ref_logprobs = self.reference_result(ready.reference)
        rollouts = [r for group in ready.groups for r in group]
        drains = step == self.boundary(step)
        update = self.submit_train(rollouts, ready.rewards, ref_logprobs)
        version = self.weights_version + 1
        if step < self.config.max_steps:
            self.rollouts.export(version)  # queued behind the update on the learner
        if not drains:
            if step + 1 + self.staleness <= self.boundary(step):
                self.dispatch(step + 1 + self.staleness, version)
            self.prepared[step + 1] = self.prepare(step + 1)  # while the learner trains
        learner_metrics = self.finish_train(update)
        self.timings["time/train"] = self.updated - update.submitted  # the update itself, whatever overlapped it
        if self.weights_version != version:
            raise RunError(f"the learner reports weights version {self.weights_version} after step {step}, expected "
                           f"{version}: its updates and the driver's steps are out of step")
        self.fit_reward_models(step, ready.stats)
        if step == self.config.max_steps:
            with self.timed("sync"):
                self.sync_weights(now=True)  # the run ends with every engine verified on the final weights
        self.timings["time/recovery"] = self.rollouts.recovery_seconds - recovering
        self.timings["time/rollout_idle"] = self.rollouts.take_idle()
        ready.stats.update({"rollout/version": ready.version, "async/staleness": version - 1 - ready.version})
        if self.config.rollout.in_flight_updates:  # tokens sampled by versions newer than the batch's (fresh groups)
            tokens = np.concatenate([np.asarray(r.versions, np.float64) for g in ready.groups[:ready.fresh] for r in g])
            ready.stats.update({"async/token_staleness": version - 1 - float(tokens.mean()),
                                "rollout/in_flight_loads": self.rollouts.take_in_flight_loads()})
        return self.record(step, rollouts, learner_metrics, self.rollouts.take_gap(), time.perf_counter() - started,
                           ready.stats)

    def boundary(self, step: int) -> int:
        """The first step from `step` on where the pipeline drains: a checkpoint step, or the last. No batch after
        it is sampled before its update, so a checkpoint there holds everything the run's continuation needs."""
        every = self.config.checkpoint.every
        return min(self.config.max_steps, -(-step // every) * every) if every else self.config.max_steps

    def fill(self, step: int) -> None:
        """Send out the batches of steps `step` .. `step + k` (up to the next drain) not yet in flight: at the start
        and after a drain, all sampled with the current weights."""
        if self.weights_version not in self.rollouts.exports:
            self.rollouts.export(self.weights_version)  # what a replaced worker loads for these batches
        for s in range(step, min(step + self.staleness, self.boundary(step)) + 1):
            if s not in self.in_flight and s not in self.prepared:
                self.dispatch(s, self.weights_version)

    def dispatch(self, step: int, version: int) -> None:
        """Draw step `step`'s prompts and queue them on the workers, to be sampled with weights version `version`."""
        problems = self.data.next_batch()
        seeds = sampling_seeds(self.config.seed, step, len(problems))
        self.in_flight[step] = (self.rollouts.dispatch(self.prompts_of(problems), seeds, self.sampling, version),
                                problems)

    def prepare(self, step: int) -> Prepared:
        """Step `step`'s batch, collected and scored, its reference logprobs asked for (not waited for). With
        dynamic sampling, the extra rounds are sampled with the batch's version too (queued behind the requests the
        workers already hold)."""
        batch, problems = self.in_flight.pop(step)

        def collect(round_: int) -> tuple[list[Problem], list[list[Any]]]:
            nonlocal batch, problems
            if round_:
                problems = self.data.next_batch()
                seeds = sampling_seeds(self.config.seed, step, len(problems), round_)
                batch = self.rollouts.dispatch(self.prompts_of(problems), seeds, self.sampling, batch.version)
            return problems, self.rollouts.collect(batch)

        outer, self.timings = self.timings, {}
        try:
            groups, rewards, stats = self.sample(step, collect)
            fresh = len(groups)
            groups, rewards = self.replay.mix(step, groups, rewards, batch.version, stats)
            rollouts = [r for group in groups for r in group]
            with self.timed("reference"):
                self.refresh_reference(step, stats)
            return Prepared(batch.version, groups, rewards, stats, self.submit_reference(rollouts), self.timings,
                            fresh)
        finally:
            self.timings = outer

    def prompts_of(self, problems: list[Problem]) -> list[Any]:
        """What the engines get for each problem: its token ids when the data source tokenised it once, else text;
        for multi-turn episodes (`env`), an `EpisodePrompt` with its text and label too (for the environment)."""
        if self.config.env.enabled:
            from actors.rollout_types import EpisodePrompt

            return [EpisodePrompt(p.prompt, p.label, p.prompt_ids) for p in problems]
        return [p.prompt if p.prompt_ids is None else p.prompt_ids for p in problems]

    @contextmanager
    def timed(self, phase: str):
        """Add the block's wall time to `time/<phase>` (a phase may run several times per step)."""
        start = time.perf_counter()
        yield
        key = f"time/{phase}"
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start

    def sample(self, step: int, rounds_from: Callable[[int], tuple[list[Problem], list[list[Any]]]] | None = None
               ) -> tuple[list[list[Any]], list[float], dict[str, Any]]:
        """Generate and score `prompts_per_step` groups; returns [prompts][G] rollouts, their rewards, and stats.
        `rounds_from(round)` gives a round's problems and their groups (default: draw prompts and generate now;
        asynchronously, `prepare` collects what was dispatched).

        Groups a remote verifier could not score under `on_failure=drop` are removed (counted in
        `verifier/dropped_groups`). With `rollout.dynamic_sampling` (DAPO), groups whose rewards are all equal
        (all right or all wrong: no signal for a group baseline) are set aside; fresh prompts are drawn until enough
        groups are kept or `max_sampling_rounds` rounds ran, after which set-aside groups top the batch up (counted,
        never hidden). Overlong shaping is added after that choice, as in DAPO, so length alone does not make a
        group informative."""
        ro, want = self.config.rollout, self.config.data.prompts_per_step
        if rounds_from is None:
            def rounds_from(round_: int) -> tuple[list[Problem], list[list[Any]]]:
                problems = self.data.next_batch()
                return problems, self.generate(problems, step, round_)
        tally = Tally([*self.config.reward.sources, *(["env"] if self.config.env.enabled else [])])
        rounds = 0
        while len(tally.kept) < want and rounds < (ro.max_sampling_rounds if ro.dynamic_sampling else 1):
            with self.timed("generate"):
                problems, groups = rounds_from(rounds)
            with self.timed("score"):
                result = self.scorer.score(problems, groups)
            for name, (prompts, completions, targets) in result.fit.items():  # reward models fine-tuned in the run
                data = self.fit_data.setdefault(step, {}).setdefault(name, ([], [], []))
                for kept, new in zip(data, (prompts, completions, targets)):
                    kept += new
            self.add_round(tally, groups, result)
            rounds += 1
        return self.choose(step, tally, rounds)

    def add_round(self, tally: Tally, groups: list[list[Any]], result: Any) -> None:
        """Count one generation round's scored groups into `tally`: dropped groups (`on_failure=drop`) left out,
        the uninformative ones (dynamic sampling) set aside, overlong shaping added."""
        dynamic = self.config.rollout.dynamic_sampling
        for key, value in result.metrics.items():
            tally.counters[key] = tally.counters.get(key, 0.0) + value if "latency" not in key else max(
                tally.counters.get(key, 0.0), value)
        for name, values in result.per_source.items():
            tally.per_source[name] += values
        steps = result.steps or [None] * len(groups)
        for group, group_rewards, lost, group_steps in zip(groups, result.rewards, result.dropped, steps):
            if lost:
                continue
            distinct = set(group_rewards)
            if group_steps is not None:  # process supervision: the steps' rewards go with the rollouts
                for rollout, scored in zip(group, group_steps):
                    rollout.step_ends, rollout.step_rewards = scored.ends, scored.rewards
                # Normalised over all the group's steps: equal rewards everywhere are the only case without signal.
                distinct |= {float(r) for scored in group_steps for r in scored.rewards}
            informative = not dynamic or len(distinct) > 1
            shaped = self.shape(group_rewards, group)
            tally.scored += shaped if group_steps is None else [
                reward + float(scored.rewards.sum()) for reward, scored in zip(shaped, group_steps)]
            (tally.kept if informative else tally.uninformative).append((group, shaped))

    def choose(self, step: int, tally: Tally, rounds: int) -> tuple[list[list[Any]], list[float], dict[str, Any]]:
        """The step's groups from `tally` (kept ones first, topped up with set-aside ones), their rewards, stats."""
        ro, want = self.config.rollout, self.config.data.prompts_per_step
        kept, uninformative, counters = tally.kept, tally.uninformative, tally.counters
        if not kept and not uninformative:
            raise RunError(f"step {step}: every group was dropped because a remote verifier could not score it "
                           f"({counters.get('verifier/failures', 0):.0f} failed samples) or its environment failed "
                           f"({counters.get('env/failures', 0):.0f} failed episodes); check the service")
        filler = uninformative[:max(0, want - len(kept))]
        chosen = kept[:want] + filler
        stats: dict[str, Any] = {"reward/mean": statistics.fmean(tally.scored),
                                 "reward/std": statistics.pstdev(tally.scored),
                                 **{f"reward/{name}": statistics.fmean(v) for name, v in tally.per_source.items() if v},
                                 **counters}
        if ro.dynamic_sampling:
            stats.update({"sampling/rounds": rounds, "sampling/kept_groups": min(len(kept), want),
                          "sampling/surplus_groups": max(0, len(kept) - want),
                          "sampling/dropped_groups": len(uninformative), "sampling/filler_groups": len(filler)})
        return [g for g, _ in chosen], [r for _, rs in chosen for r in rs], stats

    def generate(self, problems: list[Problem], step: int, round_: int = 0) -> list[list[Any]]:
        """[prompts][G] rollouts in order, one sampling seed per prompt (a replaced worker's chunk is sampled again
        with the same seeds, so a fault does not change the step)."""
        seeds = sampling_seeds(self.config.seed, step, len(problems), round_)
        return self.rollouts.generate(self.prompts_of(problems), seeds, self.sampling, check_later=True)

    def shape(self, rewards: list[float], group: list[Any]) -> list[float]:
        """Add DAPO's soft overlong penalty to one group's rewards (a no-op when `reward.overlong_buffer` is 0)."""
        rc = self.config.reward
        if not rc.overlong_buffer:
            return rewards
        max_length = self.config.rollout.max_new_tokens
        return [reward + overlong_penalty(len(rollout.response_ids), max_length, rc.overlong_buffer,
                                          rc.overlong_penalty) for reward, rollout in zip(rewards, group)]

    def fit_reward_models(self, step: int, stats: dict[str, Any]) -> None:
        """Iterative GRPO: at steps that are multiples of a reward model's `train.every`, fine-tune it on step `step`'s
        completions labelled by its `train.label_source` (the next scoring uses the new weights); its
        `reward_model/<name>/*` metrics and `time/reward_fit` go into `stats`. Examples of steps up to `step` are let
        go."""
        data = self.fit_data.pop(step, {})
        for old in [s for s in self.fit_data if s < step]:
            del self.fit_data[old]
        due = {name: examples for name, examples in data.items()
               if step % self.config.reward.sources[name].train.every == 0}
        if not due:
            return
        with self.timed("reward_fit"):
            refs = [self.fleet.reward_models[name].fit.remote(*examples, self.config.rollout.group_size)
                    for name, examples in due.items()]
            results = get(refs, self.config.timeouts.reward, [f"reward model '{name}' fine-tuning" for name in due],
                          "reward")
        for name, result in zip(due, results):
            stats.update({f"reward_model/{name}/{key}": float(value) for key, value in result.items()})

    def refresh_reference(self, step: int, stats: dict[str, Any]) -> None:
        """Iterative GRPO (`reference.refresh_every`): before step `step`'s reference pass, when due, the reference
        takes the policy's current weights (the newest version: the one the learner trains from at that step);
        `reference/version` (and the refresh probe's gap) go into `stats`."""
        refresh = self.reference_refresh
        if not refresh.every:
            return
        if refresh.due(step):
            refresh.refresh(self.rollouts.weights_version)
            stats["sync/reference_probe_diff"] = refresh.last_gap
        stats["reference/version"] = refresh.version

    def submit_reference(self, rollouts: list[Any]) -> tuple[Any, Any, float] | None:
        """Ask the reference for the logprobs of every response token: (the ref of their count, the ref of the
        flat array, when asked), or None without a reference."""
        if self.fleet.reference is None:
            return None
        from learner.algo.sequences import Rows

        count, logprobs = self.fleet.reference.compute_flat_logprobs.options(num_returns=2).remote(
            Rows(r.prompt_ids for r in rollouts), Rows(r.response_ids for r in rollouts))
        return count, logprobs, time.monotonic()

    def reference_result(self, asked: tuple[Any, Any, float] | None) -> Any:
        """The ref of the reference's logprobs once it has them (`timeouts.reference` from when they were asked
        for); None without a reference."""
        if asked is None:
            return None
        count, logprobs, since = asked
        get([count], self.reference_time_left(since), ["reference"], "reference")
        return logprobs

    def reference_time_left(self, since: float) -> float:
        """What is left of `timeouts.reference` from `since`, when the reference was asked."""
        return max(0.0, self.config.timeouts.reference - (time.monotonic() - since))

    def later(self, asked: tuple[Any, Any, float] | None) -> Later | None:
        """The reference's logprobs for the learner to wait for itself (`sync.calls.Later`), within what is left of
        `timeouts.reference` from when they were asked for; None without a reference."""
        if asked is None:
            return None
        _, logprobs, since = asked
        return Later(logprobs, self.reference_time_left(since), "reference", "reference")

    def submit_train(self, rollouts: list[Any], rewards: list[float], ref_logprobs: Any) -> Update:
        """Send the update to the learner without waiting (`finish_train` waits), and record how long the learner
        waited since its last update was done (`time/learner_wait`)."""
        from learner.algo.sequences import Rows
        from learner.learner import TrainBatch

        self.rollouts.check_pending()  # nothing trains on rollouts of weights not checked yet
        submitted = time.monotonic()
        self.timings["time/learner_wait"] = submitted - self.updated if self.updated is not None else 0.0

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
        update = Update(self.fleet.learner_group.submit_train(batch, ref_logprobs), submitted)
        update.refs[0].future().add_done_callback(lambda _: update.done.append(time.monotonic()))
        return update

    def finish_train(self, update: Update) -> dict:
        """Wait for `update` (`timeouts.train` from its submission): the learner's metrics; `weights_version` becomes
        the version it reports it produced, `updated` when it was done."""
        remaining = self.config.timeouts.train - (time.monotonic() - update.submitted)
        metrics = self.fleet.learner_group.finish(update.refs, max(0.0, remaining), "train")[0]
        self.updated = update.done[0] if update.done else time.monotonic()
        self.weights_version = int(metrics["weights/version"])
        return metrics

    def save_checkpoint(self, run_dir: Path, step: int, resolved_config: str) -> Path:
        """Write `checkpoints/step_<step>` atomically: the learner's state, the data cursor, the resolved config."""
        tmp = checkpoint.begin(run_dir, step)
        self.fleet.learner_group.save_checkpoint(str(tmp))
        checkpoint.write_driver_state(tmp, {"step": step, "weights_version": self.weights_version,
                                            "data": self.data.state(), **self.reference_refresh.save(tmp)})
        self.replay.save(tmp)
        self.save_reward_models(tmp)
        checkpoint.write_config(tmp, resolved_config)
        return checkpoint.commit(tmp, run_dir, step, self.config.checkpoint.keep)

    def trained_reward_models(self) -> list[str]:
        return [name for name, source in self.config.reward.sources.items() if getattr(source, "train", None)]

    def save_reward_models(self, directory: Path) -> None:
        """The fine-tuned reward models' weights and optimizer states, in `reward_models/<name>/`."""
        names = self.trained_reward_models()
        refs = [self.fleet.reward_models[name].save_state.remote(str(directory / REWARD_MODELS_DIR / name))
                for name in names]
        get(refs, self.config.timeouts.reward, [f"reward model '{name}'" for name in names], "checkpoint")

    def restore_reward_models(self, directory: Path) -> None:
        names = self.trained_reward_models()
        refs = [self.fleet.reward_models[name].load_state.remote(str(directory / REWARD_MODELS_DIR / name))
                for name in names]
        get(refs, self.config.timeouts.reward, [f"reward model '{name}'" for name in names], "checkpoint")

    def restore(self, point: resume.ResumePoint) -> int:
        """Load a checkpoint into the learner, the data cursor and every engine (probe-checked); returns its step."""
        version = self.fleet.learner_group.load_checkpoint(str(point.path))
        self.data.load_state(point.state["data"])
        self.reference_refresh.restore(point.path, point.state)
        self.replay.load(point.path)
        self.restore_reward_models(point.path)
        self.weights_version = version
        if self.staleness:  # the first batches load it, as in the run that drained at this checkpoint
            self.rollouts.restored(version)
        else:
            self.rollouts.sync(version)  # the first step's requests load it
        # The start's probe checked the model's weights, not the checkpoint's the next step samples with (that step's
        # requests probe those): its gap is not that step's, which must match the uninterrupted run's.
        self.rollouts.take_gap()
        return point.step

    def apply_scale_request(self) -> None:
        """Between steps (nothing is in flight): apply what `relay scale` asked since the last step (removals at once,
        new workers placed in the background), and let in the new workers whose engines are up."""
        if self.control is None:
            return
        asked, self.request = self.request or self.control.take_request.remote(), None  # answered while we trained
        request = get([asked], self.config.timeouts.sync, ["run control"], "sync")[0]
        if request is not None:
            self.rollouts.resize(request["num_workers"], request["remove"])
        self.rollouts.admit()

    def publish(self, record: dict[str, Any]) -> None:
        """Tell the control actor what the fleet is after this step (`relay status` shows it)."""
        if self.control is None:
            return
        self.control.publish.remote({  # fire and forget: the step does not wait for it
            "step": record["step"], "weights_version": self.weights_version,
            "learner_node": self.learner_node,
            "workers": [{"id": s.id, "node_id": s.node_id} for s in self.fleet.rollout],
            "workers_pending": [{"id": p.id, "state": p.state, "seconds": round(time.monotonic() - p.since, 1)}
                                for p in self.fleet.pending],
            "reward_mean": record.get("reward/mean"), "time_step": record.get("time/step"),
            "scale_failures": self.rollouts.scale_failures, "last_scale_error": self.rollouts.last_scale_error})
        # Ask for the next `relay scale` request now: the answer is there when the next step starts (no round trip in
        # it); a request made after this is taken one step later.
        self.request = self.control.take_request.remote()

    def sync_weights(self, now: bool = False) -> None:
        """Every rollout worker gets the learner's new weights, checked by the probe: at the start of its next request
        (`RolloutPool.sync`), or at once with `now` (the last step: the run ends with every engine verified on the
        final weights)."""
        self.rollouts.sync(self.weights_version, now)

    def record(self, step: int, rollouts: list[Any], learner_metrics: dict[str, float], probe_diff: float,
               step_seconds: float, sampling: dict[str, Any]) -> dict[str, Any]:
        """One metrics line. `reward/*` cover every completion scored this step (dropped groups too: they show how
        the policy does); the rest cover the completions trained on."""
        lengths = [len(r.response_ids) for r in rollouts]
        episodes = {}
        if self.config.env.enabled:  # multi-turn: what the episodes trained on did (failures: every one scored)
            infos = [r.episode for r in rollouts if r.episode is not None]
            episodes = {"env/turns/mean": statistics.fmean(e.turns for e in infos) if infos else 0.0,
                        "env/calls": float(sum(e.calls for e in infos)),
                        "env/invalid_calls": float(sum(e.invalid_calls for e in infos)),
                        "env/truncated_observations": float(sum(e.truncated_observations for e in infos)),
                        "env/episode_seconds": statistics.fmean(e.env_seconds for e in infos) if infos else 0.0,
                        "response_length/model_tokens": statistics.fmean(
                            float(np.sum(r.model_mask)) if r.model_mask is not None else len(r.response_ids)
                            for r in rollouts),
                        "time/env": self.rollouts.take_env_wait()}
        return {
            "step": step,
            **sampling,
            "rollout/completions": len(rollouts),
            "response_length/mean": statistics.fmean(lengths),
            "response/truncated_fraction": statistics.fmean(r.finish_reason == "length" for r in rollouts),
            **episodes,
            **learner_metrics,
            **self.data.metrics(),
            "weights/version": self.weights_version,
            "sync/probe_max_diff": probe_diff,
            "rollout/workers": len(self.fleet.rollout_workers),
            "rollout/workers_pending": len(self.fleet.pending),
            "rollout/scale_events": self.rollouts.scale_events,
            "rollout/scale_failures": self.rollouts.scale_failures,
            "rollout/restarts": self.rollouts.restarts,
            **self.timings,
            "time/step": step_seconds,
            "throughput/tokens_per_s": sum(lengths) / step_seconds,
        }


class RunFinished(Exception):
    """`resume` named a run that already reached `max_steps`: nothing to do (not an error)."""


def resolve_run_dir(config: RunConfig) -> Path:
    """The run directory. A new run refuses one that already holds a run; `resume` needs the run's directory
    (nothing is written here)."""
    if config.resume == "auto" and not config.run_dir:
        raise ConfigError("resume=auto continues the run in run_dir: pass run_dir=PATH of that run")
    if config.run_dir:
        run_dir = Path(config.run_dir)
    else:
        run_dir = resume.run_dir_for(config) or Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if not config.resume and ((run_dir / "metrics.jsonl").exists() or (run_dir / "config.yaml").exists()):
        raise ConfigError(f"run_dir '{run_dir}' already holds a run; pass a new run_dir=PATH, remove it, or continue "
                          "it with resume=auto")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir '{run_dir}' is a file; pass run_dir=PATH naming a directory")
    return run_dir


def prepare(config: RunConfig, model_path: str | None) -> tuple[Any, Scorer]:
    """Check every user input that can be checked before anything starts or is built, and load what the driver
    itself needs: the prompt source (dataset files are read and validated here) and the reward sources (verifiers
    imported, remote clients configured). `model_path` None is the demo model, not built yet: datasets are checked with
    its tokenizer, made in memory. Raises ConfigError (one line, nothing written) on bad input."""
    from cluster.run.data import DataError, make_prompt_source

    if model_path is not None and not (Path(model_path) / "config.json").is_file():
        raise ConfigError(f"model.path '{model_path}' is not a Hugging Face model directory (no config.json); "
                          "pass model.path=DIR or leave it empty for the demo model")
    for name, source in config.reward.sources.items():
        if isinstance(source, ModelSource) and source.path is not None and \
                not (Path(source.path) / "config.json").is_file():
            raise ConfigError(f"reward.sources.{name}.path '{source.path}' is not a Hugging Face model directory "
                              "(no config.json)")
    ro = config.rollout
    max_prompt_tokens = config.data.max_prompt_tokens or max(1, ro.max_model_len - ro.max_new_tokens)
    try:
        data = make_prompt_source(config.data, config.seed, config.data.prompts_per_step, model_path,
                                  max_prompt_tokens)
    except DataError as err:
        raise ConfigError(str(err)) from None
    try:
        check_logging(config.logging)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        scorer = Scorer(config.reward, config.timeouts.reward, config.env)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_environment(config)
    local = config.ray.address is None and not os.environ.get("RAY_ADDRESS")  # this run starts its own Ray
    cpus, asked = config.ray.num_cpus or os.cpu_count() or 1, cpus_asked(config)
    if local and not ray.is_initialized() and sum(asked.values()) > cpus + 1e-9:
        parts = " + ".join(f"{name} {value:g}" for name, value in asked.items() if value)
        raise ConfigError(f"the run asks Ray for {sum(asked.values()):g} CPUs ({parts}) but the local Ray instance has "
                          f"{cpus}: lower those num_cpus (fractions are fine: they only book Ray's CPUs, the threads "
                          "are set by num_threads) or set ray.num_cpus")
    # Asynchronously the engines, the learner and the reference compute at once: more threads than cores makes the
    # step slower than the synchronous loop's (docs/operations.md). (Asynchronously every learner and reference
    # thread count is set: `RunConfig._threads_for_overlap`.)
    if ro.max_staleness and local:
        threads = (config.learner.num_threads * config.learner.num_ranks + ro.num_workers * ro.num_threads
                   + (config.reference.num_threads if config.uses_reference else 0))
        if threads > 2 * (os.cpu_count() or 1):
            print(f"relay: warning: rollout.max_staleness={ro.max_staleness} runs the engines, the reference and the "
                  f"learner at once, and this local run gives them {threads} threads on {os.cpu_count()} cores: they "
                  "will slow each other down more than the overlap gains; lower learner/rollout/reference.num_threads "
                  "(docs/operations.md)", file=sys.stderr, flush=True)
    if ro.top_p < 1:
        print(f"relay: warning: rollout.top_p={ro.top_p:g} < 1: the engines' logprobs are renormalised over the "
              "nucleus and the learner's are not, so logprob/mismatch also measures that renormalisation "
              "(docs/operations.md)", file=sys.stderr, flush=True)
    return data, scorer


def check_environment(config: RunConfig) -> None:
    """The `env` section's class imports and takes its params (the workers load it again); raises ConfigError (one
    line, naming the key) before anything starts."""
    env = config.env
    if env.spec is not None:
        from rewards.environments.interface import load_environment

        try:
            load_environment(env.spec, env.params)
        except ValueError as err:
            raise ConfigError(f"env.spec: {err}") from None
    if env.urls and env.token_env and not os.environ.get(env.token_env):
        print(f"relay: warning: env.token_env={env.token_env} is not set here; the rollout workers read it from their "
              "own environment (set it on every node, or in the job's runtime_env)", file=sys.stderr, flush=True)


def cpus_asked(config: RunConfig) -> dict[str, float]:
    """The CPUs the run's actors book in Ray at the start (placement groups), by the config keys that set them."""
    lc, rc, ro = config.learner, config.reference, config.rollout
    engines = ro.num_cpus * ro.num_workers * ro.tensor_parallel_size
    return {"learner.num_cpus x num_ranks": lc.num_cpus * lc.num_ranks,
            "reference.num_cpus": rc.num_cpus if config.uses_reference else 0.0,
            "rollout.num_cpus x num_workers x tensor_parallel_size": engines,
            **{f"reward.sources.{name}.num_cpus": s.num_cpus for name, s in config.reward.sources.items()
               if isinstance(s, ModelSource)}}


def run_training(config: RunConfig, run_dir: Path, model_path: str | None = None, display: bool = True,
                 rollout_cls: type | None = None, pool: FleetPool | None = None) -> list[dict[str, Any]]:
    """Check the inputs, start Ray (unless connected already), ensure the demo model (shipped copy) if `model_path` and
    `model.path` are empty, start the fleet, run the steps up to `max_steps` (from the checkpoint `resume` names, if
    any), write checkpoints, and clean up; returns this attempt's records. With `pool`, the fleet is taken from it
    when one of the same shape is parked, and parked in it when the run ends (`FleetPool`; not when this call started
    Ray, which it then shuts down).

    Raises ConfigError (nothing written or built) on bad input, RunFinished when resuming a finished run, RunError
    when the run cannot go on (with the checkpoint to resume from) or Ray cannot be reached (nothing written)."""
    point = resume.find(config, run_dir)
    if point is not None and point.step >= config.max_steps:
        raise RunFinished(f"the run in {run_dir} already finished: its checkpoint {point.path.name} is at step "
                          f"{point.step} and max_steps={config.max_steps}; raise max_steps to train further")
    model_path = model_path or config.model.path
    data, scorer = prepare(config, model_path)
    records: list[dict[str, Any]] = []
    finished = False
    with ExitStack() as cleanup:  # undoes whatever was started, in reverse order, however the run ends
        cleanup.callback(scorer.close)
        started_ray = _init_ray(config)
        if started_ray:
            cleanup.callback(ray.shutdown)
        if model_path is None:
            from cluster.demo.cache import ensure_demo_model

            model_path = str(ensure_demo_model(log=lambda line: print(f"relay: {line}", file=sys.stderr),
                                               task=config.data.task))
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved_config = config.model_copy(update={"run_dir": str(run_dir)})
        resolved = dump_config(resolved_config)
        (run_dir / "config.yaml").write_text(resolved)
        recorder = MetricsRecorder(run_dir, config.logging, resolved_config.model_dump(mode="json"),
                                   resume_step=point.step if point else None)
        cleanup.callback(lambda: recorder.close(failed=not finished))
        try:
            control = start_control(str(run_dir))
            cleanup.callback(ray.kill, control)
            fleet = start_fleet(config, model_path, rollout_cls, pool)

            def release(fleet: Fleet) -> None:  # parked for the next run only if this run joined a Ray it did not start
                if pool is None or started_ray or not pool.park(fleet, failed=not finished):
                    stop_fleet(fleet)

            cleanup.callback(release, fleet)
            trainer = Trainer(config, fleet, data, scorer, control)
            cleanup.callback(trainer.rollouts.transport.close)  # the collective transport leaves its group
            if config.sync.probe:
                # Engines and learner agree on the weights they start from (the model's, also when resuming: before
                # the checkpoint loads), which is where the probe's noise floor and tolerance come from.
                trainer.rollouts.verify()
            first = trainer.restore(point) + 1 if point else 1
            trainer.publish({"step": first - 1})
            progress = ProgressDisplay(config.max_steps, start_step=first - 1) if display else None
            with progress or nullcontext():
                for step in range(first, config.max_steps + 1):
                    record = trainer.step(step)
                    recorder.write(record)
                    records.append(record)
                    trainer.publish(record)
                    if progress:
                        progress.update(record)
                    every = config.checkpoint.every
                    if step == config.max_steps or (every and step % every == 0):
                        trainer.save_checkpoint(run_dir, step, resolved)
            if progress:
                progress.summary()
            finished = True
        except RunError as err:
            latest = checkpoint.latest(run_dir)
            hint = (f"; resume from {latest.name} with: relay train run_dir={run_dir} resume=auto" if latest
                    else "; no checkpoint was written yet")
            raise type(err)(f"{err}{hint}") from err
    return records


def _init_ray(config: RunConfig) -> bool:
    """Start a local Ray instance or join the cluster at `ray.address` (or $RAY_ADDRESS, as in a Ray job); returns
    whether this call did (so the run shuts it down). A malformed address is a ConfigError; a cluster that cannot be
    reached a RunError, found within seconds (Ray itself would retry a closed GCS port for minutes)."""
    if ray.is_initialized():
        return False
    rc = config.ray
    starts = rc.address is None and not os.environ.get("RAY_ADDRESS")  # else it joins a cluster (relay submit)
    address = rc.address or os.environ.get("RAY_ADDRESS")
    try:
        check_reachable(address)
        context = ray.init(address=rc.address, num_cpus=rc.num_cpus if rc.address is None else None,
                           include_dashboard=rc.dashboard, dashboard_host="127.0.0.1", log_to_driver=rc.log_to_driver,
                           configure_logging=True, logging_level="WARNING",
                           **({"_system_config": RAY_SYSTEM_CONFIG} if starts else {}))
    except ValueError as err:  # Ray's own check of the address's form
        raise ConfigError(f"ray.address={address!r}: {str(err).splitlines()[0]}") from None
    except ConnectionError as err:
        raise RunError(f"cannot reach a Ray cluster at ray.address={address}: {str(err).splitlines()[0]}") from None
    line = dashboard_line(context)
    if line:
        print(line, file=sys.stderr, flush=True)
    return True
