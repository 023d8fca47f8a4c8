"""The rollout fleet as the driver sees it: requests queued on the workers, balanced, deadlined, and run again on a
replacement when a worker dies or hangs.

Owns: one request path for every regime (on-policy is `max_staleness` = 0: one batch in flight; asynchronously
several batches queue on each worker, each sampled with its own version): a batch's prompts split over the workers
by their measured speed (`rollout.balance`), each share queued behind what its worker holds and loading the batch's
weights first when needed, the deadline on each request (`timeouts.generate`), and recovery: a worker that dies or
misses its deadline is replaced and handed every request it held, in order, with the same seeds (`RolloutPool`).
Does not own: what a step does with the rollouts (cluster/run/trainer.py), exporting and checking the weights
(cluster/fleet/weight_sync.py), growing or shrinking the fleet (cluster/fleet/scaling.py), placement
(cluster/fleet/placement.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from cluster.config import RunConfig
from cluster.fleet.placement import Fleet, RolloutSlot
from cluster.fleet.weight_sync import Export, WeightSync
from sync.calls import Outcome, RunError, get, late, settle
from sync.transport import make_transport
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
    """Calls the fleet's rollout workers; `restarts` and `recovery_seconds` count the replacements.

    A request's deadline counts from when it reaches the front of its worker's queue and the weights it loads exist.
    A worker that dies or misses it is killed, started again in its placement group, and handed every request it
    held, in order, with the same seeds, so no prompt is lost and the batch is the same. Past
    `rollout.max_restarts` replacements the run stops, naming the worker and the cause."""

    def __init__(self, config: RunConfig, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self.restarts = 0
        self.recovery_seconds = 0.0  # spent replacing workers, over the run
        self.speeds: dict[int, float] = {}  # worker id -> prompts per second in recent steps (`rollout.balance`)
        self.transport = make_transport(config.sync, fleet.learner, config.timeouts.sync)
        self.weights = WeightSync(config, fleet, self.transport)
        self.queues: dict[int, deque[Request]] = {}  # slot id -> its requests in flight, in the order it runs them
        # slot id -> the version its engine has once its queue ran (engines start on the model's own: version 0)
        self.serving: dict[int, int] = {slot.id: 0 for slot in fleet.rollout}
        self.clock_end: dict[int, float] = {}  # slot id -> its worker's clock when its last request ended
        self.idle: dict[int, float] = {}  # slot id -> seconds its engine waited between requests, since `take_idle`
        self.env_wait: dict[int, float] = {}  # slot id -> seconds its engine waited for environments (episodes)
        # In-flight updates (`rollout.in_flight_updates`): every export is offered to every worker at once.
        self.in_flight = config.rollout.in_flight_updates
        self.offers: list[tuple[RolloutSlot, Any]] = []  # (worker, ref of its `offer_weights` call) not yet settled
        self.in_flight_loads = 0  # loads made during a request, since `take_in_flight_loads`
        self.invariance: dict[int, bool] = {}  # slot id -> whether its engine is batch-invariant (`check_invariance`)

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

    def sync_now(self, version: int) -> None:
        """Load the learner's weights (version `version`) into every worker now and verify them (the end of a run,
        and every sync of the `collective` transport); a worker that fails is replaced (and then loaded)."""
        self.weights.version = version
        if self.config.sync.fingerprint:  # computed by the learner while the workers load
            self.weights.expected = (version, self.fleet.learner.weights_fingerprint.remote())
        failed = self.load_now(self.fleet.rollout)
        for slot in self.fleet.rollout:
            if slot.id in failed:
                self.replace(slot, failed[slot.id])
        if self.config.sync.probe:
            self.weights.verify(self.fleet.rollout)

    def load_now(self, slots: list[RolloutSlot]) -> dict[int, str]:
        """Load the current weights into `slots` now (`WeightSync.load_now`); {slot id: cause} of those that failed."""
        done, failed = self.weights.load_now(slots)
        self.serving.update((slot.id, self.weights.version) for slot in done)
        return failed

    def restored(self, version: int) -> None:
        """The learner was restored to weights version `version` (nothing in flight): every worker's next request
        loads it (and probes it), as after the drain the checkpoint was written at."""
        self.weights.version = version
        self.serving = {}

    def replace(self, slot: RolloutSlot, cause: str) -> None:
        """Kill `slot`'s worker, start a new one in its bundle, load the current weights and probe them."""
        self._restart(slot, cause)  # counts its own time in `recovery_seconds`
        started = time.perf_counter()
        failed = self.load_now([slot])
        if failed:
            raise RunError(f"{slot.name} was replaced after it {cause}, but its replacement {failed[slot.id]} while "
                           "loading the weights")
        if self.config.sync.probe:
            self.weights.verify([slot])
        self.recovery_seconds += time.perf_counter() - started

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
        queue = self.queues.setdefault(slot.id, deque())
        export = self.weights.exports[batch.version] if self.serving.get(slot.id) != batch.version else None
        request.load = export
        load = export.load_args(slot.id) if export is not None else []
        kwargs: dict[str, Any] = {}
        if export is not None and export.probe is not None:
            kwargs["score_probe"] = export.probe
        elif export is not None and export.engine_probe:
            kwargs["probe"] = self.weights.probe_args()
        if self.in_flight:
            kwargs["in_flight"] = True
        a, b = request.chunk
        request.ref = slot.actor.generate.remote(batch.prompts[a:b], batch.seeds[a:b], batch.sampling, *load,
                                                 **kwargs)
        request.started = None if queue else time.monotonic()
        request.result = None
        queue.append(request)
        self.serving[slot.id] = batch.version

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
            waiting = [r for queue in self.queues.values() for r in queue]
            fronts = [q[0] for q in self.queues.values() if q]
            unready = {id(ref): ref for r in fronts if r.load is not None and r.load.ready.at is None
                       for ref in r.load.ready.refs}
            watch = [r.ref for r in waiting] + list(unready.values())
            first_deadline = min(self._deadline(r) for r in fronts)
            ray.wait(watch, num_returns=1, timeout=max(0.0, first_deadline - time.monotonic()))
            ready = set(ray.wait([r.ref for r in waiting], num_returns=len(waiting), timeout=0)[0])
            failed = self._settle_queues(ready)
            for request in [q[0] for slot_id, q in self.queues.items() if q and slot_id not in failed]:
                if request.load is not None and request.load.ready.at is None and \
                        time.monotonic() >= self.weights.export_deadline(request.load):
                    raise self.weights.late_export(request.load)
            for export in {id(r.load): r.load for sid in failed for r in self.queues[sid] if r.load}.values():
                self.weights.check_export(export)  # a learner whose export failed fails every request loading it
            for slot_id, cause in failed.items():
                self._restart_queue(slot_id, cause)
        self._settle_offers()
        self._check_batch(batch)
        # Kept: versions requests in flight may load again, this batch's (dynamic sampling's extra rounds) and the
        # newest (the next batches); the rest cannot be asked for again.
        in_flight = {r.batch.version for queue in self.queues.values() for r in queue}
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
        for slot_id, queue in self.queues.items():
            while queue and queue[0].ref in ready:
                request = queue[0]
                [request.result] = settle([request.ref], "generate")
                if not request.result.ok:
                    failed[slot_id] = request.result.error
                    break
                queue.popleft()
                a, b = request.chunk
                if request.batch.measured:
                    self._record_speed(slot_id, b - a, now - request.started)
                self._note_clock(slot_id, request.result.value)
                if queue:
                    queue[0].started = now
            if slot_id not in failed and queue and self._deadline(queue[0]) <= now and \
                    (queue[0].load is None or queue[0].load.ready.at is not None):
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
                if value.loads is None:
                    raise SyncError(f"{slot.name} returned no report of its in-flight loads "
                                    "(rollout.in_flight_updates)")
                for loaded, sample, during in value.loads:
                    version = getattr(loaded, "version", None)
                    loads.append((slot, version, loaded, sample, during))
                    export = self.weights.exports.get(version)
                    probed.append(export is not None and export.probe is not None)
            elif request.load is not None:
                loads.append((slot, batch.version, value.loaded, value.probe, False))
                probed.append(request.load.probe is not None or request.load.engine_probe)
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
        """Replace the worker of slot `slot_id` and send it every request the old one held, in order."""
        slot = next(slot for slot in self.fleet.rollout if slot.id == slot_id)
        self._restart(slot, cause)
        requests = list(self.queues.pop(slot_id))
        self.serving.pop(slot_id, None)  # a new engine: each request loads its version
        self.clock_end.pop(slot_id, None)
        for request in requests:
            self._submit(request)

    def requeue(self, requests: list[Request]) -> None:
        """Send requests whose workers left the fleet to the workers it has, round robin (each loads its version)."""
        for n, request in enumerate(requests):
            request.slot = self.fleet.rollout[n % len(self.fleet.rollout)]
            self._submit(request)

    def _restart(self, slot: RolloutSlot, cause: str) -> None:
        """Kill `slot`'s worker and start a new one in its bundle (counted against `rollout.max_restarts`); the new
        engine serves the model's own weights until it loads others."""
        limit = self.config.rollout.max_restarts
        if self.restarts >= limit:
            raise RunError(f"{slot.name} {cause}, and {self.restarts} rollout workers were already replaced "
                           f"(rollout.max_restarts={limit}); the engines keep failing, check the Ray logs")
        started = time.perf_counter()
        self.restarts += 1
        print(f"relay: {slot.name} {cause}; replacing it", file=sys.stderr, flush=True)
        ray.kill(slot.actor, no_restart=True)
        slot.actor = self.fleet.launcher.start(slot.placement)
        self.transport.fleet_changed(self.fleet.rollout_workers)
        get([slot.actor.__ray_ready__.remote()], self.config.timeouts.start, [slot.name], "start")
        self.weights.unprobed.add(slot.id)
        self.invariance.pop(slot.id, None)  # a new engine: asked again
        self.recovery_seconds += time.perf_counter() - started

    def check_invariance(self) -> bool:
        """Whether every engine is batch-invariant (`RolloutWorker.batch_invariance`), asked once of each engine that
        is new since the last call: the first call says so in one line, and an engine that is not says which
        guarantee drops."""
        new = [slot for slot in self.fleet.rollout if slot.id not in self.invariance]
        verdicts = get([slot.actor.batch_invariance.remote() for slot in new], self.config.timeouts.start,
                       [slot.name for slot in new], "report its batch invariance") if new else []
        first = not self.invariance
        for slot, (invariant, detail) in zip(new, verdicts):
            self.invariance[slot.id] = invariant
            if not invariant:
                print(f"relay: {slot.name}'s engine is not batch-invariant here ({detail}): a prompt's logprobs may "
                      "change in their last bits with what shares its engine batch, so two runs, or a run and its "
                      "resumption, give the same weights and rewards only with rollout.balance=even (or one rollout "
                      "worker); with rollout.balance=speed, logprob/mismatch, mismatch/kl and rarely a sampled token "
                      "may differ (docs/operations.md, exact resume)", file=sys.stderr, flush=True)
        if first and verdicts and all(ok for ok, _ in verdicts):
            print(f"relay: rollout engines are batch-invariant ({verdicts[0][1]})", file=sys.stderr, flush=True)
        return all(self.invariance[slot.id] for slot in self.fleet.rollout)

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
        if slot_id in self.clock_end:
            self.idle[slot_id] = self.idle.get(slot_id, 0.0) + max(0.0, groups.clock[0] - self.clock_end[slot_id])
        self.clock_end[slot_id] = groups.clock[1]

    def take_env_wait(self) -> float:
        """Multi-turn episodes: seconds the engines sat waiting for environments (nothing to generate) since the last
        call, the most of any worker."""
        waits, self.env_wait = self.env_wait, {}
        return max(waits.values(), default=0.0)

    def take_idle(self) -> float:
        """Seconds the engines waited between requests since the last call, the mean over workers that ran one."""
        idle, self.idle = self.idle, {}
        return statistics.fmean(idle.values()) if idle else 0.0
