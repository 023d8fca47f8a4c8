"""The rollout workers' life, in one place (modelled on RLlib's FaultTolerantActorManager).

Owns: which workers serve and which are on their way in (`relay scale`), what each worker's engine holds (the calls
queued on it, in order; the weights version it has once they ran; its clock; whether it is batch-invariant), their
health (restarts, counted against `rollout.max_restarts`), admission and removal, and forgetting a worker: every
fact about a worker lives in its `WorkerState`, which a restart or a removal drops whole.
Does not own: what the calls are and how a batch is split (cluster/fleet/rollout_pool.py), the weights and their
checks (cluster/fleet/weight_sync.py, told of new engines and of the fleet's changes through `watch`), placement
(cluster/fleet/placement.py), or taking requests from `relay scale` (cluster/fleet/control.py).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.config import RunConfig
from cluster.fleet.placement import Fleet, PendingWorker, RolloutSlot, node_of
from sync.calls import RunError, get, settle


@dataclass(eq=False)
class WorkerState:
    """What the driver knows of one serving worker's engine; forgotten with it."""

    queue: deque = field(default_factory=deque)  # its calls in flight (the pool's `Request`s), in order
    serving: int | None = None  # the weights version its engine has once its queue ran; None: not known
    clock_end: float | None = None  # its engine's clock when its last call ended
    invariant: bool | None = None  # whether its engine is batch-invariant, once asked


class RolloutWorkers:
    """The fleet's rollout workers (`slots`, in `Fleet.rollout`, and `pending`, in `Fleet.pending`: this class is the
    only one that changes them during a run) and what each holds; `restarts`, `recovery_seconds`, `events` and
    `failures` count what happened to them."""

    def __init__(self, config: RunConfig, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self.states: dict[int, WorkerState] = {slot.id: WorkerState(serving=0) for slot in fleet.rollout}
        self.restarts = 0  # workers replaced after a failure
        self.recovery_seconds = 0.0  # spent replacing workers, over the run
        self.events = 0  # workers added or removed by `relay scale`
        self.failures = 0  # new workers that failed to start or to load the weights, and were dropped
        self.last_error = ""
        self.next_id = max((slot.id for slot in fleet.rollout), default=-1) + 1
        self._told = False  # whether `check_invariance` said the fleet's verdict yet
        self._new_engine: list[Callable[[RolloutSlot], None]] = []
        self._changed: list[Callable[[list[Any]], None]] = []

    def watch(self, new_engine: Callable[[RolloutSlot], None], changed: Callable[[list[Any]], None]) -> None:
        """Call `new_engine(slot)` when a worker's engine is replaced and `changed(actors)` when the serving set
        changes (the weight sync's probes and transport)."""
        self._new_engine.append(new_engine)
        self._changed.append(changed)

    @property
    def slots(self) -> list[RolloutSlot]:
        return self.fleet.rollout

    @property
    def pending(self) -> list[PendingWorker]:
        return self.fleet.pending

    def _state(self, slot_id: int) -> WorkerState:
        return self.states.setdefault(slot_id, WorkerState())

    def queued(self) -> list[Any]:
        """Every call in flight, worker by worker, each worker's in order."""
        return [call for state in self.states.values() for call in state.queue]

    def queues(self) -> dict[int, deque]:
        """Each worker's calls in flight, in order (to read: `enqueue` and `done` change them)."""
        return {slot_id: state.queue for slot_id, state in self.states.items()}

    def serving(self, slot_id: int) -> int | None:
        """The weights version worker `slot_id`'s engine has once the calls queued on it ran; None: not known."""
        return self._state(slot_id).serving

    def serves(self, slot_id: int, version: int | None) -> None:
        """Worker `slot_id`'s engine has weights `version` once the calls queued on it ran (None: not known)."""
        self._state(slot_id).serving = version

    def enqueue(self, slot_id: int, call: Any, version: int) -> bool:
        """`call` was sent to worker `slot_id`, behind what it holds, sampling with weights `version`; whether it is
        the front of its queue (the worker runs it now)."""
        state = self._state(slot_id)
        state.queue.append(call)
        state.serving = version
        return len(state.queue) == 1

    def done(self, slot_id: int) -> Any:
        """Worker `slot_id`'s front call finished: take it off its queue; returns the next one, or None."""
        queue = self._state(slot_id).queue
        queue.popleft()
        return queue[0] if queue else None

    def clock(self, slot_id: int, start: float, end: float) -> float | None:
        """Worker `slot_id`'s engine ran a call from `start` to `end` (its own clock); returns how long it waited since
        its previous call ended (None for its first)."""
        state = self._state(slot_id)
        waited = None if state.clock_end is None else max(0.0, start - state.clock_end)
        state.clock_end = end
        return waited

    def forget(self, slot_id: int) -> list[Any]:
        """Drop all that is known of worker `slot_id`'s engine; returns the calls it held, in order."""
        state = self.states.pop(slot_id, None)
        return list(state.queue) if state is not None else []

    def _fleet_changed(self) -> None:
        actors = [slot.actor for slot in self.slots]
        for changed in self._changed:
            changed(actors)

    # ------------------------------------------------------------------------------------------------ health

    def restart(self, slot: RolloutSlot, cause: str,
                join: Callable[[list[RolloutSlot]], dict[int, str]] | None = None) -> list[Any]:
        """Kill `slot`'s worker and start a new one in its bundle (counted against `rollout.max_restarts`), forget the
        old engine, and return the calls it held, in order, for the caller to send again. The new engine serves the
        model's own weights until it loads others: with `join` (the pool's: load the current weights, probe them;
        {slot id: cause} of a failure), at once, else with the first call sent to it. All of it counts as
        recovery."""
        limit = self.config.rollout.max_restarts
        if self.restarts >= limit:
            raise RunError(f"{slot.name} {cause}, and {self.restarts} rollout workers were already replaced "
                           f"(rollout.max_restarts={limit}); the engines keep failing, check the Ray logs")
        started = time.perf_counter()
        self.restarts += 1
        print(f"relay: {slot.name} {cause}; replacing it", file=sys.stderr, flush=True)
        ray.kill(slot.actor, no_restart=True)
        slot.actor = self.fleet.launcher.start(slot.placement)
        held = self.forget(slot.id)
        self._fleet_changed()
        get([slot.actor.__ray_ready__.remote()], self.config.timeouts.start, [slot.name], "start")
        for new_engine in self._new_engine:
            new_engine(slot)
        failed = join([slot]) if join is not None else {}
        self.recovery_seconds += time.perf_counter() - started
        if failed:
            raise RunError(f"{slot.name} was replaced after it {cause}, but its replacement {failed[slot.id]} while "
                           "loading the weights")
        return held

    def check_invariance(self) -> bool:
        """Whether every engine is batch-invariant (`RolloutWorker.batch_invariance`), asked once of each engine that
        is new since the last call: the first call says so in one line, and an engine that is not says which
        guarantee drops."""
        new = [slot for slot in self.slots if self._state(slot.id).invariant is None]
        verdicts = get([slot.actor.batch_invariance.remote() for slot in new], self.config.timeouts.start,
                       [slot.name for slot in new], "report its batch invariance") if new else []
        first, self._told = not self._told, True
        for slot, (invariant, detail) in zip(new, verdicts):
            self._state(slot.id).invariant = invariant
            if not invariant:
                print(f"relay: {slot.name}'s engine is not batch-invariant here ({detail}): a prompt's logprobs may "
                      "change in their last bits with what shares its engine batch, so two runs, or a run and its "
                      "resumption, give the same weights and rewards only with rollout.balance=even (or one rollout "
                      "worker); with rollout.balance=speed, logprob/mismatch, mismatch/kl and rarely a sampled token "
                      "may differ (docs/operations.md, exact resume)", file=sys.stderr, flush=True)
        if first and verdicts and all(ok for ok, _ in verdicts):
            print(f"relay: rollout engines are batch-invariant ({verdicts[0][1]})", file=sys.stderr, flush=True)
        return all(self._state(slot.id).invariant for slot in self.slots)

    # ------------------------------------------------------------------------------------------------ `relay scale`

    def resize(self, num_workers: int, remove_ids: list[int] = ()) -> list[Any]:
        """Between steps: stop the workers `remove_ids` (serving or pending), then drop workers (pending ones first,
        then serving ones, newest first) or ask Ray for new ones until the fleet and the workers on their way into it
        number `num_workers`. Returns the calls the removed workers still held (asynchronous training), for the caller
        to send to the others. New workers are only placed here; `admit` starts them and adds them once they are up."""
        fleet = self.fleet
        cancelled = [p for p in fleet.pending if p.id in set(remove_ids)]
        removed = [slot for slot in fleet.rollout if slot.id in set(remove_ids)]
        pending = [p for p in fleet.pending if p not in cancelled]
        serving = [slot for slot in fleet.rollout if slot not in removed]
        surplus = len(serving) + len(pending) - num_workers
        if surplus > 0:
            cancelled += pending[len(pending) - min(surplus, len(pending)):]  # newest first (ids grow)
            surplus -= min(surplus, len(pending))
        if surplus > 0:
            removed += sorted(serving, key=lambda slot: slot.id)[-surplus:]
        if cancelled:
            fleet.pending = [p for p in fleet.pending if p not in cancelled]
            fleet.launcher.stop(cancelled, timeout=2)  # an engine still starting is killed, not waited for
        moved = []
        if removed:
            fleet.rollout = [slot for slot in fleet.rollout if slot not in removed]
            for slot in removed:
                moved += self.forget(slot.id)
            fleet.launcher.stop(removed)
            self._fleet_changed()
            self.events += len(removed)
        busy = [slot.node_id for slot in fleet.rollout]
        for _ in range(num_workers - len(fleet.rollout) - len(fleet.pending)):
            placement = fleet.launcher.place(busy)
            fleet.pending.append(PendingWorker(self.next_id, placement, placement.ready(), time.monotonic()))
            self.next_id += 1
        return moved

    def admit(self, join: Callable[[list[RolloutSlot]], dict[int, str]]) -> int:
        """At a step boundary: start the engines of pending workers that Ray has placed, and add every pending worker
        whose engine is up to the fleet, `join` loading the current weights into them (probe-checked) before their
        first call ({slot id: cause} of those that failed); returns how many joined. A worker whose engine fails to
        start, is not up within `timeouts.start` of its start, or fails its load is dropped, counted in `failures`
        and named in `last_error`. Waits for neither placement nor start-up."""
        fleet = self.fleet
        for p in fleet.pending:
            if p.actor is None and ray.wait([p.placed], timeout=0)[0]:
                p.actor = fleet.launcher.start(p.placement)
                p.started, p.since = p.actor.__ray_ready__.remote(), time.monotonic()
        starting = [p for p in fleet.pending if p.started is not None]
        up = set(ray.wait([p.started for p in starting], num_returns=len(starting), timeout=0)[0]) if starting else ()
        ready = [p for p in starting if p.started in up]
        failed: dict[int, str] = {}
        joining = []
        for p, outcome in zip(ready, settle([p.started for p in ready], "start")):
            if outcome.ok:
                joining.append(p)
            else:
                failed[p.id] = f"failed to start ({outcome.cause})"
        limit = self.config.timeouts.start
        failed.update((p.id, f"did not start within timeouts.start={limit:g} s") for p in starting
                      if p not in ready and time.monotonic() - p.since > limit)
        self._drop_new([p for p in fleet.pending if p.id in failed], failed)
        fleet.pending = [p for p in fleet.pending if p.id not in failed and p not in joining]
        if not joining:
            return 0
        new = [RolloutSlot(p.id, p.actor, p.placement, node_of(p.placement)) for p in joining]
        fleet.rollout += new
        self._fleet_changed()
        lost = join(new)
        if lost:
            self._drop_new([slot for slot in new if slot.id in lost], lost, "while loading the weights")
            fleet.rollout = [slot for slot in fleet.rollout if slot.id not in lost]
            for slot_id in lost:
                self.forget(slot_id)
            self._fleet_changed()
        self.events += len(new) - len(lost)
        return len(new) - len(lost)

    def _drop_new(self, workers: list[PendingWorker] | list[RolloutSlot], causes: dict[int, str],
                  when: str = "") -> None:
        """Stop new workers that failed on their way into the fleet, counting and reporting each."""
        if not workers:
            return
        self.fleet.launcher.stop(workers, timeout=0)
        for worker in workers:
            self.failures += 1
            self.last_error = f"new {worker.name} {causes[worker.id]}{' ' + when if when else ''}"
            print(f"relay: {self.last_error}; it was dropped, the run goes on with the workers it has",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------------------ what they are

    def metrics(self) -> dict[str, float]:
        """The step record's view of the workers."""
        return {"rollout/workers": len(self.slots), "rollout/workers_pending": len(self.pending),
                "rollout/scale_events": self.events, "rollout/scale_failures": self.failures,
                "rollout/restarts": self.restarts}

    def status(self) -> dict[str, Any]:
        """What `relay status` shows of the workers."""
        now = time.monotonic()
        return {"workers": [{"id": s.id, "node_id": s.node_id} for s in self.slots],
                "workers_pending": [{"id": p.id, "state": p.state, "seconds": round(now - p.since, 1)}
                                    for p in self.pending],
                "scale_failures": self.failures, "last_scale_error": self.last_error}
