"""The reference and the teacher as the step sees them (ReferenceWorkers): a step's logprobs asked for as soon as its
batch is scored (after the reference takes the policy's weights, when `reference.refresh_every` says so), waited for
within `timeouts.reference` / `timeouts.teacher` from when they were asked, or handed to the learner to wait for
itself (`sync.calls.Later`: on-policy, the update then goes out before they arrive: `overlaps_reference`).
Does not own: when in the step they are asked for (cluster/run/trainer.py), the refresh's load and checks
(cluster/fleet/reference_refresh.py), or what they are computed with (actors/reference.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cluster.config import RunConfig
from cluster.fleet.placement import Fleet, with_default_threads
from cluster.fleet.reference_refresh import ReferenceRefresh
from sync.calls import Later, get, time_left

Asked = tuple[Any, Any, float]  # (the ref of their count, the ref of the flat array, time.monotonic() when asked)


def overlaps_reference(config: RunConfig) -> bool:
    """Whether on-policy steps send the update before the reference's logprobs arrive (`learner.overlap_reference`),
    for a config whose thread counts are resolved (`with_default_threads`)."""
    lc, rc = config.learner, config.reference
    if lc.overlap_reference != "auto":
        return lc.overlap_reference
    return not (lc.num_gpus == 0 and rc.num_gpus == 0 and max(lc.num_threads, rc.num_threads) > 1)


class LogprobAsks:
    """The reference's and the teacher's logprobs of a step's rollouts, each asked for and then waited for; `refresh`:
    the reference's iterative-GRPO refresh (`reference.refresh_every`)."""

    def __init__(self, config: RunConfig, fleet: Fleet, weights: Any):
        """`weights`: the run's WeightSync (the refresh checks the reference against the learner as the engines are)."""
        self.fleet = fleet
        self.timeouts = config.timeouts
        self.refresh = ReferenceRefresh(config, fleet, weights)
        # On-policy, the update may go out before the reference's logprobs arrive (asynchronously they were asked for
        # a step earlier, and the update waits for them as it always did: its results stay the same bits).
        self.overlap = not config.rollout.max_staleness and overlaps_reference(
            with_default_threads(config, fleet.launcher.settings.model_path))

    def submit(self, step: int, rollouts: list[Any], version: int, stats: dict[str, Any]) -> tuple[Asked | None,
                                                                                                  Asked | None]:
        """Ask for step `step`'s reference and teacher logprobs of `rollouts`. Iterative GRPO first: when due, the
        reference takes the policy's weights `version` (the newest: the one the learner trains from at that step);
        `reference/version` (and the refresh probe's gap) go into `stats`."""
        refresh = self.refresh
        if refresh.every:
            if refresh.due(step):
                refresh.refresh(version)
                stats["sync/reference_probe_diff"] = refresh.last_gap
            stats["reference/version"] = refresh.version
        return self.submit_reference(rollouts), self.submit_teacher(rollouts)

    def for_update(self, reference: Asked | None, teacher: Asked | None, timings: Any) -> tuple[Any, Any]:
        """What the update gets: the teacher's logprobs (waited for: the learner's advantages need them;
        `time/teacher`), and the reference's, or, overlapping, the reference's still on their way (`later`: the learner
        runs its training forward while the reference computes, and waits for them before its first loss). Overlapping,
        `confirm` names the reference's failure or missed deadline after the update went out."""
        ours = self.later(reference) if self.overlap else self.reference_result(reference)
        if teacher is None:
            return ours, None
        with timings.timed("teacher"):  # the wait; the rest of the teacher's pass overlapped
            return ours, self.teacher_result(teacher)

    def confirm(self, reference: Asked | None) -> None:
        """After an overlapping update went out: the reference's failure or missed deadline is the reference's."""
        if self.overlap:
            self.reference_result(reference)

    def save(self, checkpoint_dir: Path) -> dict[str, int]:
        return self.refresh.save(checkpoint_dir)

    def restore(self, checkpoint_dir: Path, state: dict[str, Any]) -> None:
        self.refresh.restore(checkpoint_dir, state)

    @staticmethod
    def ask(actor: Any, rollouts: list[Any]) -> Asked | None:
        """Ask a ReferenceWorker (the reference, or the teacher) for the logprobs of every response token; None
        without that actor."""
        if actor is None:
            return None
        from learner.passes.sequences import Rows

        count, logprobs = actor.compute_flat_logprobs.options(num_returns=2).remote(
            Rows(r.prompt_ids for r in rollouts), Rows(r.response_ids for r in rollouts))
        return count, logprobs, time.monotonic()

    def submit_reference(self, rollouts: list[Any]) -> Asked | None:
        return self.ask(self.fleet.reference, rollouts)

    def submit_teacher(self, rollouts: list[Any]) -> Asked | None:
        """On-policy distillation's teacher, asked as the reference is."""
        return self.ask(self.fleet.teacher, rollouts)

    @staticmethod
    def result(asked: Asked | None, name: str, timeout: float) -> Any:
        """The ref of the logprobs `ask` asked `name` for, once it has them (within `timeout` s, the
        `timeouts.<name>`, from when they were asked for); None when nothing was asked."""
        if asked is None:
            return None
        count, logprobs, since = asked
        get([count], time_left(timeout, since), [name], name)
        return logprobs

    def teacher_result(self, asked: Asked | None) -> Any:
        """Waited for before the update goes out: the learner's advantages need them."""
        return self.result(asked, "teacher", self.timeouts.teacher)

    def reference_result(self, asked: Asked | None) -> Any:
        return self.result(asked, "reference", self.timeouts.reference)

    def later(self, asked: Asked | None) -> Later | None:
        """The reference's logprobs for the learner to wait for itself (`sync.calls.Later`), within what is left of
        `timeouts.reference` from when they were asked for; None without a reference."""
        if asked is None:
            return None
        _, logprobs, since = asked
        return Later(logprobs, time_left(self.timeouts.reference, since), "reference", "reference")
