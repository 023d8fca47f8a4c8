"""Calling Ray actors with a deadline: the one helper every caller uses, and the one way a failure reads.

Owns: `call_all` (a method on several actors, waited for up to a deadline), `wait_all` (the same for calls already
made), `settle` (the outcomes of calls that have finished), `get` and `values` (values, or a `RunError` naming the
actor that failed), `Later` (a call's value handed on to another actor unwaited, with its deadline), `RunError`, the
`Outcome` of one call, what is left of a deadline (`time_left`), the deadline message (`late`) and the one-line
description of an error (`describe`).
Does not own: what a caller does with a failure (replace a worker, re-form a group, stop the run). Lives in `sync/`,
the lowest layer that makes Ray calls, because the weight transports need it and `sync/` imports nothing of
`cluster/`; `cluster/` uses it for the run's calls to its actors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError


class RunError(RuntimeError):
    """The run cannot go on; the message is one line for the user."""


class Outcome(NamedTuple):
    """How one call ended: `value` when it returned, else `error` (one line: what happened during `what`)."""

    value: Any = None
    error: str | None = None
    kind: Literal["ok", "raised", "died", "late"] = "ok"  # returned, raised inside its actor, actor died, too late
    cause: str = ""  # the error alone (`describe`), without what it happened during

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def time_left(timeout: float, since: float) -> float:
    """Seconds left of `timeout` counted from `since` (a `time.monotonic()` reading, e.g. when a call was made); 0
    once it has passed."""
    return max(0.0, timeout - (time.monotonic() - since))


def call_all(actors: Sequence[Any], method: str, args: tuple | list[tuple], deadline: float, what: str,
             stop_on_failure: bool = False) -> list[Outcome]:
    """`method(*args)` on every actor (`args` one tuple for all, or a list of one tuple per actor), waited for up to
    `deadline` seconds: one Outcome per actor, in order. With `stop_on_failure`, returns at the first failure (the
    calls not finished then are "late")."""
    per_actor = args if isinstance(args, list) else [args] * len(actors)
    refs = [getattr(actor, method).remote(*a) for actor, a in zip(actors, per_actor)]
    return wait_all(refs, deadline, what, stop_on_failure)


def wait_all(refs: Sequence[Any], deadline: float, what: str, stop_on_failure: bool = False) -> list[Outcome]:
    """Wait for calls already made, up to `deadline` seconds from now: one Outcome per ref, in order."""
    refs = list(refs)
    if not refs:
        return []
    end = time.monotonic() + deadline
    done: dict[Any, Outcome] = {}  # ref -> its outcome
    pending = list(refs)
    while pending:
        wanted = 1 if stop_on_failure else len(pending)
        ready, pending = ray.wait(pending, num_returns=wanted, timeout=max(0.0, end - time.monotonic()))
        if not ready:
            break
        if pending:  # and whatever else has finished meanwhile, in the same round
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        done.update(zip(ready, settle(ready, what)))
        if stop_on_failure and any(not o.ok for o in done.values()):
            break
    return [done.get(ref) or Outcome(None, late(deadline, what), "late") for ref in refs]


def settle(refs: Sequence[Any], what: str) -> list[Outcome]:
    """The outcomes of calls that have finished: one round trip to the object store when none failed."""
    try:
        return [Outcome(value) for value in ray.get(list(refs))]
    except RayError:
        pass
    outcomes = []
    for ref in refs:
        try:
            outcomes.append(Outcome(ray.get(ref)))
        except RayTaskError as err:
            outcomes.append(Outcome(None, f"failed during '{what}' ({describe(err)})", "raised", describe(err)))
        except RayActorError as err:
            outcomes.append(Outcome(None, f"died during '{what}' ({describe(err)})", "died", describe(err)))
        except RayError as err:
            outcomes.append(Outcome(None, f"failed during '{what}' ({describe(err)})", "died", describe(err)))
    return outcomes


def late(deadline: float, what: str) -> str:
    """The one deadline message."""
    return f"missed the {deadline:g} s deadline of '{what}'"


def values(outcomes: Sequence[Outcome], names: Sequence[str], what: str) -> list[Any]:
    """The calls' values, or a RunError for the first that failed: naming every actor that missed the deadline, the
    one that raised, or the death."""
    failed = [(name, o) for name, o in zip(names, outcomes) if not o.ok]
    if not failed:
        return [o.value for o in outcomes]
    died = [(name, o) for name, o in failed if o.kind == "died"]
    raised = [(name, o) for name, o in failed if o.kind == "raised"]
    if died:
        raise RunError(f"{died[0][0]} died during '{what}': {died[0][1].cause}")
    if raised:
        raise RunError(f"{raised[0][0]} failed during '{what}': {raised[0][1].cause}")
    late_names = ", ".join(name for name, _ in failed)
    raise RunError(f"{late_names} {failed[0][1].error} (raise timeouts.{what} if the work is legitimately slow)")


def get(refs: Sequence[Any], deadline: float, names: Sequence[str], what: str) -> list[Any]:
    """The values of calls already made, within `deadline`; a missed deadline, a raise or a dead actor becomes a
    RunError naming the actor (at the first failure: the others are not waited for)."""
    return values(wait_all(refs, deadline, what, stop_on_failure=True), names, what)


class Later:
    """The value of a call already made, handed to another actor before it is ready. Ray resolves a ref passed as an
    argument before the receiving call starts, which then waits idle; wrapped in this it travels unresolved, and the
    receiver calls it where it needs the value (the learner, after its training forward, for the reference's
    logprobs), waiting up to `deadline` seconds from then: a failure or a missed deadline raises `get`'s RunError
    naming `name`."""

    def __init__(self, ref: Any, deadline: float, name: str, what: str):
        self.ref, self.deadline, self.name, self.what = ref, deadline, name, what

    def __call__(self) -> Any:
        return get([self.ref], self.deadline, [self.name], self.what)[0]


def describe(err: BaseException) -> str:
    """One line: a call that raised inside its actor by that exception's class and message (not Ray's traceback
    wall, whose first line names only the call), any other error by its own."""
    cause = err.cause if isinstance(err, RayTaskError) and err.cause is not None else err
    lines = str(cause).strip().splitlines()
    if isinstance(cause, RayActorError) and cause.actor_init_failed and lines:
        # Ray's header line names the actor; the constructor's own exception ("Class: message") comes last.
        return f"{cause.__class__.__name__}: its constructor raised {lines[-1][:300]}"
    return f"{cause.__class__.__name__}: {lines[0][:300] if lines else ''}"

