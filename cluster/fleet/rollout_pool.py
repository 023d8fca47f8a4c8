"""The rollout fleet as the driver sees it: requests queued on the workers, balanced, deadlined, and run again on a
replacement when a worker dies or hangs.

Owns: one request path for every regime (on-policy is `max_staleness` = 0: one batch in flight; asynchronously
several batches queue on each worker, each sampled with its own version): a batch's prompts split over the workers
by their measured speed (`rollout.balance`), each share queued behind what its worker holds and loading the batch's
weights first when needed, the deadline on each request (`timeouts.generate`), and recovery: a worker that dies or
misses its deadline is replaced (cluster/fleet/workers.py) and handed every request it held, in order, with the same
seeds (`RolloutPool`).
Does not own: what a step does with the rollouts (cluster/run/trainer.py), exporting and checking the weights
(cluster/fleet/weight_sync.py), the workers' life: restarts, `relay scale`, what each holds (cluster/fleet/workers.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from cluster.config import RunConfig
from cluster.fleet.placement import Fleet, RolloutSlot
from cluster.fleet.weight_sync import Export, WeightSync
from cluster.fleet.workers import RolloutWorkers
from sync.calls import Outcome, late, settle
from sync.verify import SyncError

SPEED_BAND = 0.1  # relative speed differences treated as noise by `rollout.balance=speed`


@dataclass(eq=False)
class Request:
    """One worker's share of a batch in flight."""

    batch: Batch
    slot: RolloutSlot
    chunk: tuple[int, int]  # prompts [a, b) of the batch
    load: Export | None = None  # the weights it loads first (its worker's previous request sampled another version)
    ref: Any = None
    started: float | None = None  # when it reached the front of its worker's queue
    result: Outcome | None = None


@dataclass(eq=False)
class Batch:
    """One step's prompts in flight (`RolloutPool.dispatch`), sampled with weights version `version`."""

    prompts: list
    seeds: list[int]
    sampling: Any
    version: int
    requests: list[Request] = field(default_factory=list)
    measured: bool = True  # its requests' speeds count for `rollout.balance` (evaluation's do not)


class RolloutPool:
    """Calls the fleet's rollout workers (`workers`: their life, cluster/fleet/workers.py).

    A request's deadline counts from when it reaches the front of its worker's queue and the weights it loads exist.
    A worker that dies or misses it is killed, started again in its placement group, and handed every request it
    held, in order, with the same seeds, so no prompt is lost and the batch is the same. Past
    `rollout.max_restarts` replacements the run stops, naming the worker and the cause."""

    def __init__(self, config: RunConfig, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self.workers = RolloutWorkers(config, fleet)
        self.weights = WeightSync(config, fleet, self.workers)
        self.speeds: dict[int, float] = {}  # worker id -> prompts per second in recent steps (`rollout.balance`)
        self.recovered = 0.0  # `workers.recovery_seconds` at the last `step_metrics`
        self.idle: dict[int, float] = {}  # slot id -> seconds its engine waited between requests, since `take_idle`
        self.env_wait: dict[int, float] = {}  # slot id -> seconds its engine waited for environments (episodes)
        # In-flight updates (`rollout.in_flight_updates`): every export is offered to every worker at once.
        self.in_flight = config.rollout.in_flight_updates
        self.offers: list[tuple[RolloutSlot, Any]] = []  # (worker, ref of its `offer_weights` call) not yet settled
        self.in_flight_loads = 0  # loads made during a request, since `take_in_flight_loads`

    @property
    def weights_version(self) -> int:
        return self.weights.version

    # ------------------------------------------------------------------------------------------------ the weights

    def export(self, version: int) -> None:
        """The learner's weights as of its calls so far become version `version`, which the requests sent from now on
        with that version load (`WeightSync.export`); asked for now, the learner exports them after any update it runs.
        With a transport that cannot defer a load (`collective`), every worker loads them now."""
        if self.config.sync.transport == "collective":  # both ends of a collective take part at once
            self.sync_now(version)
            return
        export = self.weights.export(version, self.fleet.rollout)
        if self.in_flight:
            for slot in self.fleet.rollout:
                self.offers.append((slot, slot.actor.offer_weights.options(concurrency_group="weights").remote(
                    version, export.probe, *export.load_args(slot.id)[1:])))

    def ensure_exported(self, version: int) -> None:
        """`export(version)` unless it was exported (what a replaced worker loads for the batches sent now)."""
        if version not in self.weights.exports:
            self.export(version)

    def sync_now(self, version: int) -> None:
        """Load the learner's weights (version `version`) into every worker now and verify them (the end of a run,
        and every sync of the `collective` transport); a worker that fails is replaced (and then loaded)."""
        self.weights.begin_sync(version)
        failed = self.load_now(self.fleet.rollout)
        for slot in self.fleet.rollout:
            if slot.id in failed:
                self.replace(slot, failed[slot.id])
        if self.config.sync.probe:
            self.weights.verify(self.fleet.rollout)

    def load_now(self, slots: list[RolloutSlot]) -> dict[int, str]:
        """Load the current weights into `slots` now (`WeightSync.load_now`); {slot id: cause} of those that failed."""
        done, failed = self.weights.load_now(slots)
        for slot in done:
            self.workers.serves(slot.id, self.weights.version)
        return failed

    def restored(self, version: int, speeds: dict[str, float] | None = None) -> None:
        """The learner was restored to weights version `version` (nothing in flight): every worker's next request
        loads it (and probes it), as after the drain the checkpoint was written at; `speeds`: the workers' measured
        speeds the checkpoint holds (`save_speeds`)."""
        self.weights.restored(version)
        for slot in self.fleet.rollout:
            self.workers.serves(slot.id, None)
        if speeds is not None:
            self.speeds = {int(slot_id): speed for slot_id, speed in speeds.items()}

    def save_speeds(self) -> dict[str, float]:
        """The workers' measured speeds, for a checkpoint (they split the next batch)."""
        return {str(slot_id): speed for slot_id, speed in self.speeds.items()}

    def probe_all(self) -> float:
        """Probe every worker now (`WeightSync.verify`): at the start, engines and learner on the weights they start
        from, which is where the probe's noise floor and tolerance come from."""
        return self.weights.verify(self.fleet.rollout)

    def checked(self) -> None:
        """Every rollout collected so far is checked: the probes the engines sampled and the learner scored
        meanwhile are checked now (`WeightSync.check_pending`; SyncError if one fails)."""
        self.weights.check_pending()

    def status(self) -> dict[str, Any]:
        """What `relay status` shows of the workers (`RolloutWorkers.status`)."""
        return self.workers.status()

    def close(self) -> None:
        """The `collective` transport leaves its group."""
        self.weights.transport.close()

    def replace(self, slot: RolloutSlot, cause: str) -> None:
        """Kill `slot`'s worker, start a new one in its bundle, load the current weights and probe them
        (`RolloutWorkers.restart`); then the requests it held go to the new one."""
        for request in self.workers.restart(slot, cause, self._join):
            self._submit(request)

    def resize(self, num_workers: int, remove_ids: list[int] = ()) -> None:
        """`relay scale` between steps (`RolloutWorkers.resize`): the requests removed workers held go to the
        others."""
        self.requeue(self.workers.resize(num_workers, remove_ids))

    def admit(self) -> int:
        """Let in the new workers whose engines are up, each loaded with the current weights and probe-checked
        (`RolloutWorkers.admit`); returns how many joined."""
        return self.workers.admit(self._join)

    def _join(self, slots: list[RolloutSlot]) -> dict[int, str]:
        failed = self.load_now(slots)
        joined = [slot for slot in slots if slot.id not in failed]
        if self.config.sync.probe and joined:
            self.weights.verify(joined)
        return failed

    # ------------------------------------------------------------------------------------------------ the requests

    def generate(self, prompts: list[str | Any], seeds: list[int], sampling: Any) -> list[list[Any]]:
        """[prompts][G] rollouts sampled with the current weights (`dispatch` then `collect`), every check made."""
        groups = self.collect(self.dispatch(prompts, seeds, sampling, self.weights.version))
        self.weights.check_pending()
        return groups

    def dispatch(self, prompts: list[str | Any], seeds: list[int], sampling: Any, version: int,
                 evaluation: bool = False) -> Batch:
        """Queue a batch on the workers, to be sampled with weights version `version` (exported by `export`; a worker
        whose previous request sampled another version loads it first, and probes it). Each prompt has its own seed,
        so the result does not depend on which worker serves it. Returns at once; `collect` waits for it. An
        `evaluation` batch is split evenly over the workers in order (the same engine batches in every run of the
        fleet's size) and its speeds are not measured (the training batches' split stays what it would be)."""
        shares = self._shares(len(prompts), even=evaluation)
        starts = [sum(shares[:i]) for i in range(len(shares) + 1)]
        batch = Batch(prompts, seeds, sampling, version, measured=not evaluation)
        for i, slot in enumerate(self.fleet.rollout):
            if shares[i]:
                batch.requests.append(Request(batch, slot, (starts[i], starts[i + 1])))
                self._submit(batch.requests[-1])
        return batch

    def _submit(self, request: Request) -> None:
        """Send `request` to its slot's worker, behind the requests it already holds."""
        batch, slot = request.batch, request.slot
        export = self.weights.exports[batch.version] if self.workers.serving(slot.id) != batch.version else None
        request.load = export
        load = export.load_args(slot.id) if export is not None else []
        kwargs: dict[str, Any] = {}
        if export is not None and export.probe is not None:
            kwargs["probe"] = export.probe  # the engine samples it, or scores the learner's sample (`WeightSync.probe`)
        if self.in_flight:
            kwargs["in_flight"] = True
        a, b = request.chunk
        request.ref = slot.actor.generate.remote(batch.prompts[a:b], batch.seeds[a:b], batch.sampling, *load,
                                                 **kwargs)
        request.result = None
        request.started = time.monotonic() if self.workers.enqueue(slot.id, request, batch.version) else None

    def _deadline(self, request: Request) -> float:
        """When the front request of a queue is late: `timeouts.generate` after it reached the front and the weights
        it loads were exported (an update the export waits behind is not the worker's time); while they are not, the
        export's own deadline."""
        timeout = self.config.timeouts.generate
        if request.load is None:
            return request.started + timeout
        ready = request.load.ready.at
        if ready is None:
            return self.weights.export_deadline(request.load)
        return max(request.started, ready) + timeout

    def collect(self, batch: Batch) -> list[list[Any]]:
        """Wait for `batch` ([prompts][G] rollouts in prompt order), replacing workers that die or miss their
        deadline (`_deadline`): the replacement runs every request the worker held again, in order, each loading its
        version first, with the same seeds. Every load is checked (version, fingerprints; the probes the learner
        already scored) before this returns, and every rollout's version; the probes the engines sampled are left to
        `WeightSync.check_pending` (the learner scores them meanwhile)."""
        while any(r.result is None or not r.result.ok for r in batch.requests):
            waiting = self.workers.queued()
            queues = self.workers.queues()
            fronts = [q[0] for q in queues.values() if q]
            unready = {id(ref): ref for r in fronts if r.load is not None and r.load.ready.at is None
                       for ref in r.load.ready.refs}
            watch = [r.ref for r in waiting] + list(unready.values())
            first_deadline = min(self._deadline(r) for r in fronts)
            ray.wait(watch, num_returns=1, timeout=max(0.0, first_deadline - time.monotonic()))
            ready = set(ray.wait([r.ref for r in waiting], num_returns=len(waiting), timeout=0)[0])
            failed = self._settle_queues(ready)
            for request in [q[0] for slot_id, q in queues.items() if q and slot_id not in failed]:
                if request.load is not None and request.load.ready.at is None and \
                        time.monotonic() >= self.weights.export_deadline(request.load):
                    raise self.weights.late_export(request.load)
            for export in {id(r.load): r.load for sid in failed for r in queues[sid] if r.load}.values():
                self.weights.check_export(export)  # a learner whose export failed fails every request loading it
            for slot_id, cause in failed.items():
                self._restart_queue(slot_id, cause)
        self._settle_offers()
        self._check_batch(batch)
        # Kept: versions requests in flight may load again, this batch's (dynamic sampling's extra rounds) and the
        # newest (the next batches); the rest cannot be asked for again.
        in_flight = {r.batch.version for r in self.workers.queued()}
        self.weights.prune(min(in_flight | {batch.version, max(self.weights.exports, default=batch.version)}))
        groups = [group for r in sorted(batch.requests, key=lambda r: r.chunk) for group in r.result.value]
        if self.in_flight:  # each token: the batch's version or a newer one the worker loaded (`_check_batch`)
            versions = np.concatenate([np.asarray(r.versions, np.int64) for g in groups for r in g] or [[]])
            if versions.size and not batch.version <= versions.min() <= versions.max() <= self.weights.version:
                raise SyncError(f"tokens came from weights versions {versions.min()}..{versions.max()}, but the batch "
                                f"was to be sampled with {batch.version} or a newer exported version: a worker missed "
                                "a load")
            return groups
        stale = {r.weights_version for g in groups for r in g} - {batch.version}
        if stale:
            raise SyncError(f"rollouts came from weights version {sorted(stale)} but the batch was to be sampled with "
                            f"{batch.version}: a worker missed a load")
        return groups

    def _settle_queues(self, ready: set[Any]) -> dict[int, str]:
        """Take the finished requests off the fronts of their workers' queues (a worker runs its requests in order);
        returns {slot id: cause} of the workers whose front request failed or is late."""
        now = time.monotonic()
        failed: dict[int, str] = {}
        for slot_id, queue in self.workers.queues().items():
            front = queue[0] if queue else None
            while front is not None and front.ref in ready:
                [front.result] = settle([front.ref], "generate")
                if not front.result.ok:
                    failed[slot_id] = front.result.error
                    break
                a, b = front.chunk
                if front.batch.measured:
                    self._record_speed(slot_id, b - a, now - front.started)
                self._note_clock(slot_id, front.result.value)
                front = self.workers.done(slot_id)
                if front is not None:
                    front.started = now
            if slot_id not in failed and front is not None and self._deadline(front) <= now and \
                    (front.load is None or front.load.ready.at is not None):
                failed[slot_id] = late(self.config.timeouts.generate, "generate")
        return failed

    def _check_batch(self, batch: Batch) -> None:
        """Check the loads `batch`'s requests made (workers in order) and the probes they ran (`WeightSync`).
        A request loads the batch's version first when its worker's previous request sampled another; with in-flight
        updates it reports every load it made (at its start, the newest of its own version and the offered ones,
        probed at once; during it, each newer offer, the last one probed after the request)."""
        loads, probed = [], []
        for request in batch.requests:
            value, slot = request.result.value, request.slot
            if self.in_flight:
                for loaded, sample, during in value.loads:
                    version = getattr(loaded, "version", None)
                    loads.append((slot, version, loaded, sample, during))
                    export = self.weights.exports.get(version)
                    probed.append(export is not None and export.probe is not None)
            elif request.load is not None:
                loads.append((slot, batch.version, value.loaded, value.probe, False))
                probed.append(request.load.probe is not None)
        self.in_flight_loads += self.weights.check_loads(loads, probed)

    def _settle_offers(self) -> None:
        """Check the in-flight offers that finished: one that raised stops the run (a worker that died is replaced
        when its request fails)."""
        if not self.offers:
            return
        ready = set(ray.wait([ref for _, ref in self.offers], num_returns=len(self.offers), timeout=0)[0])
        done = [(slot, ref) for slot, ref in self.offers if ref in ready]
        self.offers = [(slot, ref) for slot, ref in self.offers if ref not in ready]
        for (slot, _), outcome in zip(done, settle([ref for _, ref in done], "offer_weights")):
            if outcome.kind == "raised":
                raise SyncError(f"{slot.name} {outcome.error}: it cannot take in-flight weight updates")

    def take_in_flight_loads(self) -> int:
        """Loads the engines made during a request since the last call (in-flight updates)."""
        loads, self.in_flight_loads = self.in_flight_loads, 0
        return loads

    def _restart_queue(self, slot_id: int, cause: str) -> None:
        """Replace the worker of slot `slot_id` and send it every request the old one held, in order (a new engine:
        each loads its version)."""
        slot = next(slot for slot in self.fleet.rollout if slot.id == slot_id)
        for request in self.workers.restart(slot, cause):
            self._submit(request)

    def requeue(self, requests: list[Request]) -> None:
        """Send requests whose workers left the fleet to the workers it has, round robin (each loads its version)."""
        for n, request in enumerate(requests):
            request.slot = self.fleet.rollout[n % len(self.fleet.rollout)]
            self._submit(request)

    def check_invariance(self) -> bool:
        """Whether every engine is batch-invariant (`RolloutWorkers.check_invariance`)."""
        return self.workers.check_invariance()

    def step_metrics(self) -> dict[str, float]:
        """The fleet's part of a step's record, each counted since the last call: the largest probe gap, the workers
        and what happened to them, whether every engine is batch-invariant, the replacements' time, the engines'
        idle time (and, with `env`, their wait for environments)."""
        recovered, self.recovered = self.recovered, self.workers.recovery_seconds
        metrics = {"sync/probe_max_diff": self.weights.take_gap(), **self.workers.metrics(),
                   "engine/batch_invariant": float(self.check_invariance()),
                   "time/recovery": self.workers.recovery_seconds - recovered, "time/rollout_idle": self.take_idle()}
        if self.config.env.enabled:
            metrics["time/env"] = self.take_env_wait()
        return metrics

    # ------------------------------------------------------------------------------------------------ balancing

    def _shares(self, count: int, even: bool = False) -> list[int]:
        """Prompts per worker (by index): in proportion to each worker's speed (`balance=speed`, unless `even`;
        workers not yet measured count as the mean), at least one each while there are enough prompts to keep speeds
        measured.
        Speeds within SPEED_BAND of the fleet's median count as the median: a one-prompt shift that measurement noise
        would cause costs more than it gains (a worker given 9 prompts instead of 8 takes ~10% longer, and sets the
        step's pace)."""
        ids = [slot.id for slot in self.fleet.rollout]
        known = [self.speeds[i] for i in ids if i in self.speeds]
        if self.config.rollout.balance == "even" or even or not known:
            weights = [1.0] * len(ids)
        else:
            weights = [self.speeds.get(i, sum(known) / len(known)) for i in ids]
            median = statistics.median(weights)
            weights = [median if abs(w / median - 1) <= SPEED_BAND else w for w in weights]
        floor = 1 if count >= len(ids) else 0
        rest = count - floor * len(ids)
        exact = [rest * w / sum(weights) for w in weights]
        shares = [int(x) for x in exact]
        by_remainder = sorted(range(len(ids)), key=lambda i: (shares[i] - exact[i], i))
        for i in by_remainder[:rest - sum(shares)]:  # largest remainders first
            shares[i] += 1
        return [floor + share for share in shares]

    def _record_speed(self, slot_id: int, prompts: int, seconds: float) -> None:
        """Prompts per second of worker `slot_id`'s last request, averaged over steps (half-life of one step)."""
        rate = prompts / max(seconds, 1e-6)
        self.speeds[slot_id] = rate if slot_id not in self.speeds else 0.5 * self.speeds[slot_id] + 0.5 * rate

    def _note_clock(self, slot_id: int, groups: Any) -> None:
        """Add the time worker `slot_id`'s engine waited between its previous request and this one (its own clock:
        waiting for the request, or for the weights it loads first) to `idle`."""
        if getattr(groups, "env_wait_s", 0.0):
            self.env_wait[slot_id] = self.env_wait.get(slot_id, 0.0) + groups.env_wait_s
        if groups.clock is None:
            return
        waited = self.workers.clock(slot_id, *groups.clock)
        if waited is not None:
            self.idle[slot_id] = self.idle.get(slot_id, 0.0) + waited

    def take_env_wait(self) -> float:
        """Multi-turn episodes: seconds the engines sat waiting for environments (nothing to generate) since the last
        call, the most of any worker."""
        waits, self.env_wait = self.env_wait, {}
        return max(waits.values(), default=0.0)

    def take_idle(self) -> float:
        """Seconds the engines waited between requests since the last call, the mean over workers that ran one."""
        idle, self.idle = self.idle, {}
        return statistics.fmean(idle.values()) if idle else 0.0
