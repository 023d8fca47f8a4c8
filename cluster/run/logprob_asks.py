"""A step's logprobs from the reference and the teacher (ReferenceWorkers): asked for as soon as its batch is scored,
waited for within `timeouts.reference` / `timeouts.teacher` from when they were asked, or handed to the learner to wait
for itself (`sync.calls.Later`: the update then goes out before they arrive).
Does not own: when they are asked for and waited for (`cluster.run.trainer`), or what they are computed with
(actors/reference.py).
"""

from __future__ import annotations

import time
from typing import Any

from cluster.fleet.placement import Fleet
from cluster.run_sections import TimeoutConfig
from sync.calls import Later, get, time_left

Asked = tuple[Any, Any, float]  # (the ref of their count, the ref of the flat array, time.monotonic() when asked)


class LogprobAsks:
    """The reference's and the teacher's logprobs of a step's rollouts, each asked for and then waited for."""

    def __init__(self, fleet: Fleet, timeouts: TimeoutConfig):
        self.fleet = fleet
        self.timeouts = timeouts

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
