"""The training step: one pipeline for on-policy and asynchronous training.

Owns: `Trainer.step` (docs/architecture.md, one step: take `relay scale` requests -> keep k + 1 batches in flight ->
collect, score and reference-score this step's batch -> learn -> export the new weights -> record), where on-policy
training is the case `rollout.max_staleness` = 0: the batch of step t is sampled with weights version exactly
max(c, t - 1 - k), c the latest step where the pipeline drained (a checkpoint step, or where the run or its resume
started); iterative GRPO's schedule (replayed groups mixed into a batch, reward models fine-tuned on a step's
completions after its update, the reference refreshed); and writing and restoring checkpoints through the fleet.
Does not own: starting and ending a run (cluster/run/launch.py), choosing a step's groups (cluster/run/sampling.py),
the requests and the weights' checks (cluster/fleet/), prompts (cluster/run/data.py), combining rewards
(cluster/run/scoring.py), the reference's and teacher's logprobs (cluster/run/logprob_asks.py), the replay buffer
(cluster/run/replay.py), metrics (cluster/run/metrics.py), checkpoint files (cluster/run/checkpoint.py), the math.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import RunConfig
from cluster.demo.task import Problem
from cluster.fleet.placement import Fleet, node_of, with_default_threads
from cluster.fleet.reference_refresh import ReferenceRefresh
from cluster.fleet.rollout_pool import Batch, RolloutPool
from cluster.fleet.scaling import Scaling
from cluster.run import checkpoint, resume
from cluster.run.data import sampling_seeds
from cluster.run.evaluation import Evaluation
from cluster.run.logprob_asks import Asked, LogprobAsks
from cluster.run.replay import ReplayBuffer
from cluster.run.sampling import Tally, add_round, choose
from cluster.run.scoring import Scorer
from rewards.steps import token_step_rewards
from sync.calls import RunError, get, time_left

REWARD_MODELS_DIR = "reward_models"  # a checkpoint's fine-tuned reward models, one directory each


@dataclass
class Prepared:
    """One step's batch, collected and scored, its reference logprobs asked for."""

    version: int  # the weights version that sampled it
    groups: list[list[Any]]
    rewards: list[float]
    stats: dict[str, Any]
    reference: Asked | None  # `LogprobAsks.submit_reference`
    teacher: Asked | None  # `LogprobAsks.submit_teacher`
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
    """Runs steps over a started fleet; each `step` returns the metrics records it completed (`step`)."""

    def __init__(self, config: RunConfig, fleet: Fleet, data: Any, scorer: Scorer, control: Any = None,
                 evaluation: tuple[list[Problem], Scorer] | None = None):
        """`evaluation`: the evaluation prompts and their Scorer (`evaluation.evaluation_inputs`), with `eval.every`."""
        from actors.rollout import SamplingSettings

        self.config = config
        self.fleet = fleet
        self.data = data  # a prompt source (cluster/run/data.py): next_batch() -> list[Problem]
        ro = config.rollout
        self.sampling = SamplingSettings(ro.group_size, ro.max_new_tokens, ro.temperature, ro.top_p)
        self.scorer = scorer
        scorer.attach(fleet.reward_models, fleet.launcher.settings.model_path)
        self.rollouts = RolloutPool(config, fleet)
        self.rollouts.check_invariance()  # one line at the start: whether runs repeat bit for bit on this machine
        self.scaling = Scaling(self.rollouts)
        self.logprobs = LogprobAsks(fleet, config.timeouts)  # the reference's and the teacher's
        self.reference_refresh = ReferenceRefresh(config, fleet, self.rollouts.weights)  # `reference.refresh_every`
        dc = config.data
        self.replay = ReplayBuffer(dc.replay_fraction, dc.replay_buffer_size, config.seed, dc.prompts_per_step)
        self.fit_data: dict[int, dict[str, tuple[list, list, list]]] = {}  # step -> reward model -> its examples
        self.weights_version = 0
        self.timings: dict[str, float] = {}
        self.control = control  # the run's mailbox in the cluster's registry (`relay scale`: a RunHandle), if any
        self.asked: tuple[Any, float] | None = None  # the pending ask for a `relay scale` request: (ref, when asked)
        # The learner's placement group is fixed for the run: ask Ray for its node once, not in every step.
        self.learner_node = node_of(fleet.placement) if control is not None else None
        self.updated: float | None = None  # time.monotonic() when the learner's last update was done
        self.staleness = ro.max_staleness
        # On-policy, the update may go out before the reference's logprobs arrive (asynchronously they were asked for
        # a step earlier, and the update waits for them as it always did: its results stay the same bits).
        self.overlap_reference = not self.staleness and overlaps_reference(
            with_default_threads(config, fleet.launcher.settings.model_path))
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
        k = 0: the latest). While the learner trains on it, the engines sample the next k batches
        (each worker loads a new version between its requests), and the driver collects, scores and asks the
        reference for the next one; after the update, the next batch goes out carrying the new weights, which each
        worker loads (and probes) at the start of its request. The last step loads and verifies them everywhere at
        once: the run ends with every engine on the final weights."""
        self.timings = {"time/sync": 0.0}
        started = time.perf_counter()
        recovering = self.rollouts.recovery_seconds
        with self.timed("scale"):
            self.apply_scale_request()
        sent = time.perf_counter()
        self.fill(step)
        sent = time.perf_counter() - sent
        ready = self.prepared.pop(step, None) or self.prepare(step)
        self.timings.update(ready.timings)  # its generate and score times: overlapped with the last update if early
        self.timings["time/generate"] += sent  # sending the batches out is generation's too
        rollouts = [r for group in ready.groups for r in group]
        update = self.send_update(ready, rollouts)
        version = self.weights_version + 1
        evaluating = self.evaluation is not None and self.evaluation.due(step)
        overlapped = self.while_training(step, version, evaluating)
        learner_metrics = self.finish_update(step, update, version)
        done = []
        if self.held is not None:  # the last step's evaluation ran beside this step's update
            done.append({**self.held, **self.evaluation.collect()})
            self.held = None
        self.fit_reward_models(step, ready.stats)
        if step == self.config.max_steps:
            with self.timed("sync"):
                self.rollouts.sync_now(version)
            if evaluating:
                self.evaluation.dispatch(step, version)
        evaluated = self.evaluation.collect() if evaluating and not overlapped else {}
        self.timings["time/recovery"] = self.rollouts.recovery_seconds - recovering
        self.timings["time/rollout_idle"] = self.rollouts.take_idle()
        self.add_version_stats(ready, version)
        record = self.record(step, rollouts, learner_metrics, self.rollouts.weights.take_gap(),
                             time.perf_counter() - started, ready.stats)
        if evaluating and overlapped:
            self.held = record  # completed by the next step, which collects its evaluation
        else:
            done.append({**record, **evaluated})
        return done

    def send_update(self, ready: Prepared, rollouts: list[Any]) -> Update:
        """Send the update on the step's batch, with the teacher's logprobs and the reference's (or, overlapping, the
        reference's still on their way: `LogprobAsks.later`; the learner runs its training forward while the reference
        computes, and waits for them before its first loss)."""
        with self.timed("reference"):
            reference = self.logprobs.later(ready.reference) if self.overlap_reference else \
                self.logprobs.reference_result(ready.reference)
            teacher = None
            if ready.teacher is not None:  # `time/teacher`: the wait, the rest of the teacher's pass overlapped
                with self.timed("teacher"):
                    teacher = self.logprobs.teacher_result(ready.teacher)
            update = self.submit_train(rollouts, ready.rewards, reference, teacher)
            if self.overlap_reference:  # its failure or missed deadline is the reference's, named here
                self.logprobs.reference_result(ready.reference)
        return update

    def while_training(self, step: int, version: int, evaluating: bool) -> bool:
        """While the learner trains: export `version`, the weights it will produce (queued behind the update), and,
        asynchronously between drains, send out the batch k steps ahead and this step's evaluation and prepare the
        next step's batch. Returns whether it overlapped (the evaluation is then collected by the next step)."""
        if step < self.config.max_steps:
            with self.timed("sync"):
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

    def finish_update(self, step: int, update: Update, version: int) -> dict[str, float]:
        """The learner's metrics of `update`, which must have produced weights version `version`."""
        with self.timed("train"):
            learner_metrics = self.finish_train(update)
        if self.staleness:  # the phases overlap: the update itself, from its submission to its result
            self.timings["time/train"] = self.updated - update.submitted
        if self.weights_version != version:
            raise RunError(f"the learner reports weights version {self.weights_version} after step {step}, expected "
                           f"{version}: its updates and the driver's steps are out of step")
        return learner_metrics

    def add_version_stats(self, ready: Prepared, version: int) -> None:
        """The version that sampled the batch and its staleness; with in-flight updates, that of its tokens."""
        ready.stats.update({"rollout/version": ready.version, "async/staleness": version - 1 - ready.version})
        if self.config.rollout.in_flight_updates:  # tokens sampled by versions newer than the batch's (fresh groups)
            tokens = np.concatenate([np.asarray(r.versions, np.float64) for g in ready.groups[:ready.fresh] for r in g])
            ready.stats.update({"async/token_staleness": version - 1 - float(tokens.mean()),
                                "rollout/in_flight_loads": self.rollouts.take_in_flight_loads()})

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
        if self.weights_version not in self.rollouts.weights.exports:
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
            return Prepared(batch.version, groups, rewards, stats, self.logprobs.submit_reference(rollouts),
                            self.logprobs.submit_teacher(rollouts), self.timings, fresh)
        finally:
            self.timings = outer

    def sample(self, step: int, rounds_from: Callable[[int], tuple[list[Problem], list[list[Any]]]]
               ) -> tuple[list[list[Any]], list[float], dict[str, Any]]:
        """Score generation rounds (`rounds_from(round)`: a round's problems and their groups) into
        `prompts_per_step` groups (cluster/run/sampling.py); returns [prompts][G] rollouts, their rewards, and stats.
        Groups a remote verifier or environment lost under `on_failure=drop` are left out (counted). With
        `rollout.dynamic_sampling` (DAPO), uninformative groups are set aside and fresh prompts are drawn until enough
        groups are kept or `max_sampling_rounds` rounds ran, after which set-aside groups top the batch up (counted,
        never hidden)."""
        ro, want = self.config.rollout, self.config.data.prompts_per_step
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
            add_round(self.config, tally, groups, result)
            rounds += 1
        return choose(self.config, step, tally, rounds)

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

    def submit_train(self, rollouts: list[Any], rewards: list[float], ref_logprobs: Any,
                     teacher_logprobs: Any = None) -> Update:
        """Send the update to the learner without waiting (`finish_train` waits), and record how long the learner
        waited since its last update was done (`time/learner_wait`)."""
        from learner.learner import TrainBatch
        from learner.passes.sequences import Rows

        self.rollouts.weights.check_pending()  # nothing trains on rollouts of weights not checked yet
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
        update = Update(self.fleet.learner_group.submit_train(batch, ref_logprobs, teacher_logprobs), submitted)
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
        """Write `checkpoints/step_<step>` atomically: the learner's state, the data cursor, the workers' measured
        speeds (they split the next batch: engine batches decide the last bits of the behaviour logprobs), the
        resolved config."""
        tmp = checkpoint.begin(run_dir, step)
        self.fleet.learner_group.save_checkpoint(str(tmp))
        speeds = {str(slot_id): speed for slot_id, speed in self.rollouts.speeds.items()}
        checkpoint.write_driver_state(tmp, {"step": step, "weights_version": self.weights_version,
                                            "data": self.data.state(), "rollout_speeds": speeds,
                                            **self.reference_refresh.save(tmp)})
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
        self.rollouts.restored(version)  # the first batches load it, as in the run that drained at this checkpoint
        self.rollouts.speeds = {int(slot_id): speed for slot_id, speed in point.state.get("rollout_speeds", {}).items()}
        # The start's probe checked the model's weights, not the checkpoint's the next step samples with (that step's
        # requests probe those): its gap is not that step's, which must match the uninterrupted run's.
        self.rollouts.weights.take_gap()
        return point.step

    def apply_scale_request(self) -> None:
        """Between steps: apply what `relay scale` asked since the last step (removals at once,
        new workers placed in the background), and let in the new workers whose engines are up."""
        if self.control is None:
            return
        asked, since = self.asked or (self.control.take_request(), time.monotonic())
        self.asked = None
        [request] = get([asked], time_left(self.config.timeouts.sync, since), ["run control"], "sync")
        if request is not None:
            self.scaling.resize(request["num_workers"], request["remove"])
        self.scaling.admit()

    def publish(self, record: dict[str, Any]) -> None:
        """Tell the run's mailbox what the fleet is after this step (`relay status` shows it)."""
        if self.control is None:
            return
        self.control.publish({  # fire and forget: the step does not wait for it
            "step": record["step"], "weights_version": self.weights_version,
            "learner_node": self.learner_node,
            "workers": [{"id": s.id, "node_id": s.node_id} for s in self.fleet.rollout],
            "workers_pending": [{"id": p.id, "state": p.state, "seconds": round(time.monotonic() - p.since, 1)}
                                for p in self.fleet.pending],
            "reward_mean": record.get("reward/mean"), "time_step": record.get("time/step"),
            "scale_failures": self.scaling.failures, "last_scale_error": self.scaling.last_error})
        # Ask for the next `relay scale` request now: the answer is there when the next step starts (no round trip in
        # it); a request made after this is taken one step later.
        self.asked = self.control.take_request(), time.monotonic()

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
            "rollout/scale_events": self.scaling.events,
            "rollout/scale_failures": self.scaling.failures,
            "rollout/restarts": self.rollouts.restarts,
            "engine/batch_invariant": float(self.rollouts.check_invariance()),
            **self.timings,
            "time/step": step_seconds,
            "throughput/tokens_per_s": sum(lengths) / step_seconds,
        }
