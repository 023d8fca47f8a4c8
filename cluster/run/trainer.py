"""The training step as a recipe: sample, score, reference/teacher, update, sync, record; one pipeline for on-policy
and asynchronous training.

Owns: `Trainer.step` (docs/architecture.md, one step) and its schedule: on-policy training is the case
`rollout.max_staleness` = 0; the batch of step t is sampled with weights version exactly max(c, t - 1 - k), c the
latest step where the pipeline drained (a checkpoint step, or where the run or its resume started); batches sent out
ahead (`fill`, `dispatch`), collected and scored (`prepare`), and the evaluation held beside the next update.
Does not own, each a part with its own state: the rounds of a step (cluster/run/sampling.py), the requests and the
weights (cluster/fleet/rollout_pool.py), the reference and teacher (cluster/run/logprob_asks.py), the learner's
updates (`Updates`, cluster/fleet/learner_group.py), rewards and reward-model fitting (cluster/run/scoring.py),
checkpoints (cluster/run/run_state.py), `relay scale` (`ScaleRequests`, cluster/fleet/control.py), the record
(cluster/run/metrics.py), prompts (cluster/run/data.py), replay (cluster/run/replay.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import RunConfig
from cluster.demo.task import Problem
from cluster.fleet.control import ScaleRequests
from cluster.fleet.learner_group import Update, Updates
from cluster.fleet.placement import Fleet
from cluster.fleet.rollout_pool import Batch, RolloutPool
from cluster.run import resume
from cluster.run.data import sampling_seeds
from cluster.run.evaluation import Evaluation
from cluster.run.logprob_asks import Asked, LogprobAsks
from cluster.run.metrics import Timings, step_record, version_stats
from cluster.run.replay import ReplayBuffer
from cluster.run.run_state import RunState
from cluster.run.sampling import sample_rounds
from cluster.run.scoring import RewardFitting, Scorer


@dataclass
class Prepared:
    """One step's batch, collected and scored, its reference logprobs asked for."""

    version: int  # the weights version that sampled it
    groups: list[list[Any]]
    rewards: list[float]
    stats: dict[str, Any]
    reference: Asked | None  # `LogprobAsks.submit`
    teacher: Asked | None
    timings: Timings  # its time/generate and time/score
    fresh: int  # groups sampled for this step: the first ones of `groups` (replayed groups follow)


class Trainer:
    """Runs steps over a started fleet; each `step` returns the metrics records it completed (`step`)."""

    def __init__(self, config: RunConfig, fleet: Fleet, data: Any, scorer: Scorer, control: Any = None,
                 evaluation: tuple[list[Problem], Scorer] | None = None):
        """`control`: the run's mailbox (`relay scale`); `evaluation`: the evaluation prompts and their Scorer
        (`evaluation.evaluation_inputs`), with `eval.every`."""
        from actors.rollout import SamplingSettings

        self.config = config
        self.data = data  # a prompt source (cluster/run/data.py): next_batch() -> list[Problem]
        ro = config.rollout
        self.sampling = SamplingSettings(ro.group_size, ro.max_new_tokens, ro.temperature, ro.top_p)
        self.scorer = scorer
        scorer.attach(fleet.reward_models, fleet.launcher.settings.model_path)
        self.rollouts = RolloutPool(config, fleet)
        self.rollouts.check_invariance()  # one line at the start: whether runs repeat bit for bit on this machine
        self.logprobs = LogprobAsks(config, fleet, self.rollouts.weights)
        self.updates = Updates(config, fleet.learner_group, gate=self.rollouts.checked)
        self.fitting = RewardFitting(config, fleet)
        dc = config.data
        self.replay = ReplayBuffer(dc.replay_fraction, dc.replay_buffer_size, config.seed, dc.prompts_per_step)
        self.state = RunState(config, fleet.learner_group, self.updates, self.rollouts, data, self.logprobs,
                              self.replay, self.fitting)
        self.control = ScaleRequests(config, control, self.rollouts, fleet.placement)
        self.staleness = ro.max_staleness
        self.timings = Timings()
        self.in_flight: dict[int, tuple[Batch, list[Problem]]] = {}  # batches sent out, by step
        self.prepared: dict[int, Prepared] = {}  # batches collected and scored ahead of their step
        self.evaluation: Evaluation | None = None
        if evaluation is not None:
            problems, eval_scorer = evaluation
            eval_scorer.attach({name: actor for name, actor in fleet.reward_models.items()
                                if name in eval_scorer.config.sources}, fleet.launcher.settings.model_path)
            self.evaluation = Evaluation(config, self.rollouts, eval_scorer, problems, self.prompts_of(problems))
        self.held: dict[str, Any] | None = None  # the last step's record, waiting for its evaluation

    def step(self, step: int) -> list[dict[str, Any]]:
        """One step; returns the records it completed: its own, unless its evaluation (`eval`) overlaps the next
        update (asynchronously, between drains: the next step completes it), and the last step's held that way.
        The weights of step t's batch are exactly version max(c, t - 1 - k) (`rollout.max_staleness` = k; on-policy
        k = 0: the latest). While the learner trains on it, the engines sample the next k batches (each worker loads
        a new version between its requests), and the driver collects, scores and asks the reference for the next
        one; after the update, the next batch goes out carrying the new weights, which each worker loads (and
        probes) at the start of its request. The last step loads and verifies them everywhere at once: the run ends
        with every engine on the final weights."""
        self.timings = timings = Timings({"time/sync": 0.0})
        started = time.perf_counter()
        with timings.timed("scale"):
            self.control.apply()  # `relay scale`, between steps
        with timings.timed("generate"):  # sending the batches out is generation's too
            self.fill(step)
        ready = self.prepared.pop(step, None) or self.prepare(step)  # sampled, scored, reference asked
        for key, seconds in ready.timings.items():  # its own times: overlapped with the last update if early
            timings[key] = timings.get(key, 0.0) + seconds
        rollouts = [r for group in ready.groups for r in group]
        with timings.timed("reference"):  # the reference's and teacher's logprobs, then the update goes out
            reference, teacher = self.logprobs.for_update(ready.reference, ready.teacher, timings)
            update = self.updates.submit(rollouts, ready.rewards, reference, teacher, timings)
            self.logprobs.confirm(ready.reference)
        version = self.updates.version + 1
        evaluating = self.evaluation is not None and self.evaluation.due(step)
        overlapped = self.while_training(step, version, evaluating)  # export; the next batches
        learner_metrics = self.finish_update(step, update)
        done = []
        if self.held is not None:  # the last step's evaluation ran beside this step's update
            done.append({**self.held, **self.evaluation.collect()})
            self.held = None
        ready.stats.update(self.fitting.fit(step, timings))  # iterative GRPO's reward models
        if step == self.config.max_steps:  # every engine ends on the final weights
            with timings.timed("sync"):
                self.rollouts.sync_now(version)
            if evaluating:
                self.evaluation.dispatch(step, version)
        evaluated = self.evaluation.collect() if evaluating and not overlapped else {}
        ready.stats.update(version_stats(self.config, ready.groups, ready.fresh, ready.version, version,
                                         self.rollouts.take_in_flight_loads()))
        record = step_record(self.config, step, rollouts, ready.stats,
                             [learner_metrics, self.data.metrics(), {"weights/version": self.updates.version},
                              self.rollouts.step_metrics()], timings, time.perf_counter() - started)
        if evaluating and overlapped:
            self.held = record  # completed by the next step, which collects its evaluation
        else:
            done.append({**record, **evaluated})
        return done

    def while_training(self, step: int, version: int, evaluating: bool) -> bool:
        """While the learner trains: export `version`, the weights it will produce (queued behind the update), and,
        asynchronously between drains, send out the batch k steps ahead and this step's evaluation and prepare the
        next step's batch. Returns whether it overlapped (the evaluation is then collected by the next step)."""
        if step < self.config.max_steps:
            with self.timings.timed("sync"):
                self.rollouts.export(version)  # queued behind the update on the learner
        overlapped = self.staleness and step != self.boundary(step)
        if overlapped:
            if step + 1 + self.staleness <= self.boundary(step):
                self.dispatch(step + 1 + self.staleness, version)
            if evaluating:  # behind the next batch; collected while the next update runs
                self.evaluation.dispatch(step, version)
            self.prepared[step + 1] = self.prepare(step + 1)  # while the learner trains
        elif evaluating and step < self.config.max_steps:
            self.evaluation.dispatch(step, version)
        return overlapped

    def finish_update(self, step: int, update: Update) -> dict[str, float]:
        """The learner's metrics of `update` (`time/train`: overlapping, the update itself, from its submission to
        its result)."""
        with self.timings.timed("train"):
            learner_metrics = self.updates.finish(update, step)
        if self.staleness:
            self.timings["time/train"] = self.updates.updated - update.submitted
        return learner_metrics

    def release_held(self) -> list[dict[str, Any]]:
        """The held record (a step whose evaluation overlaps the next update), its evaluation collected, for a run that
        stops before that update: the next step would have completed it. Empty when none is held."""
        held, self.held = self.held, None
        return [] if held is None else [{**held, **self.evaluation.collect()}]

    def boundary(self, step: int) -> int:
        """The first step from `step` on where the pipeline drains: a checkpoint step, or the last. No batch after
        it is sampled before its update, so a checkpoint there holds everything the run's continuation needs."""
        every = self.config.checkpoint.every
        return min(self.config.max_steps, -(-step // every) * every) if every else self.config.max_steps

    def fill(self, step: int) -> None:
        """Send out the batches of steps `step` .. `step + k` (up to the next drain) not yet in flight: at the start
        and after a drain, all sampled with the current weights."""
        self.rollouts.ensure_exported(self.updates.version)  # what a replaced worker loads for these batches
        for s in range(step, min(step + self.staleness, self.boundary(step)) + 1):
            if s not in self.in_flight and s not in self.prepared:
                self.dispatch(s, self.updates.version)

    def dispatch(self, step: int, version: int) -> None:
        """Draw step `step`'s prompts and queue them on the workers, to be sampled with weights version `version`."""
        problems = self.data.next_batch()
        seeds = sampling_seeds(self.config.seed, step, len(problems))
        self.in_flight[step] = (self.rollouts.dispatch(self.prompts_of(problems), seeds, self.sampling, version),
                                problems)

    def prepare(self, step: int) -> Prepared:
        """Step `step`'s batch, collected and scored (dynamic sampling's extra rounds sampled with the batch's version
        too, queued behind the requests the workers already hold), replayed groups mixed in, its reference and teacher
        logprobs asked for (not waited for)."""
        batch, problems = self.in_flight.pop(step)

        def collect(round_: int) -> tuple[list[Problem], list[list[Any]]]:
            nonlocal batch, problems
            if round_:
                problems = self.data.next_batch()
                seeds = sampling_seeds(self.config.seed, step, len(problems), round_)
                batch = self.rollouts.dispatch(self.prompts_of(problems), seeds, self.sampling, batch.version)
            return problems, self.rollouts.collect(batch)

        timings = Timings()
        groups, rewards, stats = sample_rounds(self.config, step, collect, self.scorer, timings, self.fitting)
        fresh = len(groups)
        if self.replay.count:  # iterative GRPO's replayed groups (`data.replay_fraction`)
            groups, rewards = self.replay.mix(step, groups, rewards, batch.version, stats)
        with timings.timed("reference"):
            reference, teacher = self.logprobs.submit(step, [r for group in groups for r in group],
                                                      self.rollouts.weights_version, stats)
        return Prepared(batch.version, groups, rewards, stats, reference, teacher, timings, fresh)

    def prompts_of(self, problems: list[Problem]) -> list[Any]:
        """What the engines get for each problem: its token ids when the data source tokenised it once, else text;
        for multi-turn episodes (`env`), an `EpisodePrompt` with its text and label too (for the environment)."""
        if self.config.env.enabled:
            from actors.rollout_types import EpisodePrompt

            return [EpisodePrompt(p.prompt, p.label, p.prompt_ids) for p in problems]
        return [p.prompt if p.prompt_ids is None else p.prompt_ids for p in problems]

    def save_checkpoint(self, run_dir: Path, step: int, resolved_config: str) -> Path:
        """`RunState.save`: every part's state in `checkpoints/step_<step>`."""
        return self.state.save(run_dir, step, resolved_config)

    def restore(self, point: resume.ResumePoint) -> int:
        """`RunState.restore`; returns the checkpoint's step."""
        return self.state.restore(point)

    def publish(self, record: dict[str, Any]) -> None:
        """Tell the run's mailbox what the fleet is after this step (`relay status`)."""
        self.control.publish(record, self.updates.version)

    def close(self) -> None:
        self.rollouts.close()
