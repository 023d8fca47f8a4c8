"""Growing and shrinking the rollout fleet between steps (`relay scale`).

Owns: `resize` (removed workers are stopped between steps and the requests they still held go to the others; new
ones are only placed, in the background) and `admit` (at the first step boundary after a new worker's engine is up,
it joins with the current weights, probe-checked, before its first request: the step loop never waits for Ray to find
room), with the counters `relay status` and the metrics show. A new worker that fails on its way in is dropped and
counted; the run goes on with the fleet it has.
Does not own: the requests (cluster/fleet/rollout_pool.py), the weights' checks (cluster/fleet/weight_sync.py),
placement (cluster/fleet/placement.py), or taking requests from `relay scale` (cluster/fleet/control.py).
"""

from __future__ import annotations

import sys
import time

import ray

from cluster.fleet.placement import PendingWorker, RolloutSlot, node_of
from cluster.fleet.rollout_pool import RolloutPool
from sync.calls import settle


class Scaling:
    """Resizes the pool's fleet; `events` counts workers added or removed, `failures` new workers dropped."""

    def __init__(self, pool: RolloutPool):
        self.pool = pool
        self.fleet = pool.fleet
        self.events = 0  # workers added or removed by `relay scale`
        self.failures = 0  # new workers that failed to start or to load the weights, and were dropped
        self.last_error = ""
        self.next_id = max((slot.id for slot in pool.fleet.rollout), default=-1) + 1

    def resize(self, num_workers: int, remove_ids: list[int] = ()) -> None:
        """Between steps: stop the workers `remove_ids` (serving or pending), then drop workers (pending ones first,
        then serving ones, newest first) or ask Ray for new ones until the fleet and the workers on their way into it
        number `num_workers`. New workers are only placed here; `admit` starts them and adds them once they are up."""
        fleet, pool = self.fleet, self.pool
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
        if removed:
            fleet.rollout = [slot for slot in fleet.rollout if slot not in removed]
            moved = []  # asynchronous training: requests the removed workers still held go to the others
            for slot in removed:
                moved += pool.queues.pop(slot.id, ())
                pool.serving.pop(slot.id, None)
            fleet.launcher.stop(removed)
            pool.transport.fleet_changed(fleet.rollout_workers)
            self.events += len(removed)
            pool.requeue(moved)
        busy = [slot.node_id for slot in fleet.rollout]
        for _ in range(num_workers - len(fleet.rollout) - len(fleet.pending)):
            placement = fleet.launcher.place(busy)
            fleet.pending.append(PendingWorker(self.next_id, placement, placement.ready(), time.monotonic()))
            self.next_id += 1

    def admit(self) -> int:
        """At a step boundary: start the engines of pending workers that Ray has placed, and add every pending worker
        whose engine is up to the fleet, loaded with the current weights and probe-checked before its first request;
        returns how many joined. A worker whose engine fails to start, is not up within `timeouts.start` of its
        start, or fails its load is dropped, counted in `failures` and named in `last_error`. Waits for neither
        placement nor start-up."""
        fleet, pool = self.fleet, self.pool
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
        limit = pool.config.timeouts.start
        failed.update((p.id, f"did not start within timeouts.start={limit:g} s") for p in starting
                      if p not in ready and time.monotonic() - p.since > limit)
        self._drop_new([p for p in fleet.pending if p.id in failed], failed)
        fleet.pending = [p for p in fleet.pending if p.id not in failed and p not in joining]
        if not joining:
            return 0
        new = [RolloutSlot(p.id, p.actor, p.placement, node_of(p.placement)) for p in joining]
        fleet.rollout += new
        pool.transport.fleet_changed(fleet.rollout_workers)
        lost = pool.load_now(new)
        if lost:
            self._drop_new([slot for slot in new if slot.id in lost], lost, "while loading the weights")
            fleet.rollout = [slot for slot in fleet.rollout if slot.id not in lost]
            pool.transport.fleet_changed(fleet.rollout_workers)
        joined = [slot for slot in new if slot.id not in lost]
        if pool.config.sync.probe and joined:
            pool.weights.verify(joined)
        self.events += len(joined)
        return len(joined)

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
