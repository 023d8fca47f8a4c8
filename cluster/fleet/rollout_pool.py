"""The rollout fleet as the driver sees it: generation balanced over the workers, verified weight sync, replacing
workers that die or hang, and growing or shrinking the fleet between steps.

Owns: splitting prompts over the workers in proportion to their measured speed (load balancing), the deadline on every
worker call, loading the learner's weights into the engines through the configured transport (sync/transport.py)
and checking that each engine received exactly them (the fingerprints) and serves them (the probe), recovery (a
worker that dies or misses its deadline is killed, started again in its placement group, given the current weights,
checked by the probe, and handed its request again, so no prompt is lost; past `rollout.max_restarts` replacements
the run stops naming the worker and the cause), and resizing (`resize`: removed workers are stopped between steps,
when they hold no prompts; new ones are placed and started in the background, and `admit` adds each at the first step
boundary after its engine is up, with the current weights, probe-checked, before its first request: the step loop
never waits for Ray to find room).
Does not own: what a step does with the rollouts (cluster/run/driver.py), placement (cluster/fleet/placement.py),
moving the weights (sync/transport.py) or the rules that decide a check (sync/verify.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from cluster.config import RunConfig
from cluster.fleet.placement import Fleet, PendingWorker, RolloutSlot, node_of
from sync.calls import Outcome, RunError, call_all, get, late, settle, values
from sync.transport import make_transport
from sync.verify import (
    PROBE_SEED,
    ProbeRecord,
    SyncError,
    check_loaded,
    digest,
    next_probe_record,
    probe_tolerance_from,
    probe_tolerance_min,
    stale_probe,
)

if TYPE_CHECKING:
    from actors.rollout import ProbeSample
    from sync.receive import Loaded


SPEED_BAND = 0.1  # relative speed differences treated as noise by `rollout.balance=speed`


@dataclass(eq=False)
class Export:
    """Asynchronous training: one weights version the learner exported, kept while requests that sample with it may
    still run (a replaced worker loads it again)."""

    version: int
    load: list  # `[version, *bucket refs]`: RolloutWorker.generate's load arguments
    fingerprints: Any = None  # the learner's fingerprints of it (a ref until read), with `sync.fingerprint`
    probe: Any = None  # rank 0's ref of the learner's probe sample (`Learner.probe_sample`), with `sync.probe`


@dataclass(eq=False)
class Probes:
    """Probe samples sent to the learner to score (`RolloutPool.score_probes`), to be checked (`check_probes`)."""

    slots: list[RolloutSlot]  # the workers that ran them, in order
    samples: list[ProbeSample]
    asked: dict[tuple, list[Any]]  # (prompt ids, response ids) -> the refs of every learner rank's logprobs of it
    since: float  # time.monotonic() when asked


@dataclass(eq=False)
class Request:
    """One worker's share of a batch in flight."""

    batch: Batch
    slot: RolloutSlot
    chunk: tuple[int, int]  # prompts [a, b) of the batch
    load: bool = False  # it loads the batch's version first (its worker's previous request sampled another)
    ref: Any = None
    started: float | None = None  # when its deadline began: dispatched to an idle worker, or its predecessor ended
    result: Outcome | None = None


@dataclass(eq=False)
class Batch:
    """One step's prompts in flight (`RolloutPool.dispatch`), sampled with weights version `version`."""

    prompts: list
    seeds: list[int]
    sampling: Any
    version: int
    requests: list[Request] = field(default_factory=list)


class RolloutPool:
    """Calls the fleet's rollout workers; `restarts` and `recovery_seconds` count the replacements."""

    def __init__(self, config: RunConfig, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self.weights_version = 0  # what every worker serves
        self.restarts = 0
        self.recovery_seconds = 0.0  # spent replacing workers, over the run
        self.scale_events = 0  # workers added or removed by `relay scale`
        self.scale_failures = 0  # new workers that failed to start or to load the weights, and were dropped
        self.speeds: dict[int, float] = {}  # worker id -> prompts per second in recent steps (`rollout.balance`)
        self.last_scale_error = ""
        self.next_id = max((slot.id for slot in fleet.rollout), default=-1) + 1
        self.transport = make_transport(config.sync, fleet.learner, config.timeouts.sync)
        # With a transport that allows it, a sync only exports the weights: each worker loads them at the start of
        # its next `generate`, and runs the probe right after with `sync.probe` (one call per worker per step
        # instead of three). slot id -> the `version, *buckets` to send.
        self.deferred: dict[int, list] = {}
        self.gaps: list[float] = []  # the probes' largest gaps since `take_gap`
        # Slot ids of workers whose engine is new or loaded weights since it was last probed: its next probe must find
        # nothing of the probe's prompt in the prefix cache. Tracked here, not by the workers being checked.
        self.unprobed: set[int] = {slot.id for slot in fleet.rollout}
        # The probe's tolerance: `sync.probe_tolerance`, or derived from the first probe's gaps (`verify`).
        self.tolerance: float | None = config.sync.probe_tolerance
        self.noise: float | None = None  # the first probe's largest gap: engines and learner on the same weights
        self.probes: dict[int, ProbeRecord] = {}  # slot id -> its engine's probe when its output last changed
        self.pending: Probes | None = None  # probes of a `generate(..., check_later=True)`, not checked yet
        self.expected: tuple[int, Any] | None = None  # (version, the learner's fingerprints of it, or their ref)
        # Asynchronous training (`rollout.max_staleness` >= 1): requests queue on the workers, several batches deep.
        self.probe_prompt: list[int] | None = None  # the probe prompt's tokens, once a worker ran the probe
        self.probe_sample: tuple[list[int], list[int]] | None = None  # (prompt, response) of the latest probe checked
        self.queues: dict[int, deque[Request]] = {}  # slot id -> its requests in flight, in the order it runs them
        # slot id -> the version its engine has once its queue ran (engines start on the model's own: version 0)
        self.serving: dict[int, int] = {slot.id: 0 for slot in fleet.rollout}
        self.exports: dict[int, Export] = {}  # version -> its export, while requests may need it
        self.clock_end: dict[int, float] = {}  # slot id -> its worker's clock when its last request ended
        self.idle: dict[int, float] = {}  # slot id -> seconds its engine waited between requests, since `take_idle`
        self.env_wait: dict[int, float] = {}  # slot id -> seconds its engine waited for environments (episodes)
        # In-flight updates (`rollout.in_flight_updates`): every export is offered to every worker at once.
        self.in_flight = config.rollout.in_flight_updates
        self.offers: list[tuple[RolloutSlot, Any]] = []  # (worker, ref of its `offer_weights` call) not yet settled
        self.in_flight_loads = 0  # loads made during a request, since `take_in_flight_loads`

    @property
    def workers(self) -> list[Any]:
        return self.fleet.rollout_workers

    def generate(self, prompts: list[str | Any], seeds: list[int], sampling: Any, check_later: bool = False
                 ) -> list[list[Any]]:
        """[prompts][G] rollouts in prompt order, each prompt (text, or its token ids) sampled with its own seed (so
        the result does not depend on which worker serves a prompt). Every load its requests made is checked before
        it returns, and the probes that followed them are sent to the learner to score; with `check_later` their
        check is left to `check_pending` (the learner scores them while the caller goes on: the caller calls it
        before anything trains on the rollouts), else it is made here.

        Each worker gets one request per step (one engine batch), sized by `rollout.balance`: with `speed`, in
        proportion to the prompts per second it managed in recent steps, so a slow worker gets fewer prompts and
        the fleet finishes together. A request whose worker dies or misses `timeouts.generate` goes to the worker's
        replacement."""
        self.check_pending()
        shares = self._shares(len(prompts))
        starts = [sum(shares[:i]) for i in range(len(shares) + 1)]
        todo = deque((i, (starts[i], starts[i + 1])) for i in range(len(shares)) if shares[i])
        running: dict[Any, tuple[int, tuple[int, int], float]] = {}  # ref -> (worker index, chunk, dispatched at)
        results: dict[int, list[list[Any]]] = {}  # chunk start -> groups
        loaded: dict[int, Loaded | None] = {}  # worker index -> the report of the deferred load its request made
        probed: dict[int, ProbeSample] = {}  # worker index -> the probe its request ran after that load
        timeout = self.config.timeouts.generate
        while todo or running:
            while todo:
                worker, (a, b) = todo.popleft()
                slot_id = self.fleet.rollout[worker].id
                load = self.deferred.get(slot_id, [])
                probe = {"probe": self.probe_args()} if load and self.config.sync.probe else {}
                ref = self.workers[worker].generate.remote(prompts[a:b], seeds[a:b], sampling, *load, **probe)
                running[ref] = (worker, (a, b), time.monotonic())
            first_deadline = min(started for _, _, started in running.values()) + timeout
            ray.wait(list(running), num_returns=1, timeout=max(0.0, first_deadline - time.monotonic()))
            ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
            now = time.monotonic()
            failed: dict[int, str] = {}
            errored: list[int] = []
            for ref, outcome in zip(ready, settle(ready, "generate")):
                worker, (a, b), started = running.pop(ref)
                if outcome.ok:
                    results[a] = value = outcome.value
                    slot_id = self.fleet.rollout[worker].id
                    self._record_speed(slot_id, b - a, now - started)
                    self._note_clock(slot_id, value)
                    if self.deferred.pop(slot_id, None) is not None:  # it loaded them first
                        loaded[worker] = value.loaded
                        self.unprobed.add(slot_id)
                        if self.config.sync.probe:
                            probed[worker] = value.probe
                else:
                    errored.append(worker)
                    failed[worker] = outcome.error
                    todo.append((worker, (a, b)))
            for ref, (worker, chunk, started) in list(running.items()):
                if started + timeout <= now:
                    running.pop(ref)
                    failed[worker] = late(timeout, "generate")
                    todo.append((worker, chunk))
            if any(self.fleet.rollout[worker].id in self.deferred for worker in errored):
                # Their requests carried the weights: a dead learner fails them all, and then stops the run.
                self.transport.check_learner()
            for worker, cause in failed.items():
                self.replace(worker, cause)  # its request then goes to the replacement (deferred load dropped)
        for worker in sorted(loaded):  # checked before anything is trained on the rollouts, workers in order
            self.check_loaded(worker, loaded[worker])
            if worker in probed and probed[worker] is None:
                raise SyncError(f"weight sync check failed: {self.fleet.rollout_names[worker]} (version "
                                f"{self.weights_version}) was asked to run the probe with its request but returned "
                                "none")
        if probed:
            self.pending = self.score_probes(sorted(probed), probed)
            if not check_later:
                self.check_pending()
        groups = [group for start in sorted(results) for group in results[start]]
        stale = {r.weights_version for g in groups for r in g} - {self.weights_version}
        if stale:
            raise SyncError(f"rollouts came from weights version {sorted(stale)} but the learner is at "
                            f"{self.weights_version}: a worker missed a sync")
        return groups

    def check_pending(self) -> None:
        """Check the probes `generate(..., check_later=True)` left (`verify`'s rules: SyncError if one fails)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.check_probes(pending)

    def _shares(self, count: int) -> list[int]:
        """Prompts per worker (by index): in proportion to each worker's speed (`balance=speed`; workers not yet
        measured count as the mean), at least one each while there are enough prompts to keep speeds measured.
        Speeds within SPEED_BAND of the fleet's median count as the median: a one-prompt shift that measurement noise
        would cause costs more than it gains (a worker given 9 prompts instead of 8 takes ~10% longer, and sets the
        step's pace)."""
        ids = [slot.id for slot in self.fleet.rollout]
        known = [self.speeds[i] for i in ids if i in self.speeds]
        if self.config.rollout.balance == "even" or not known:
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

    # ------------------------------------------------------------------ asynchronous training (max_staleness >= 1)

    def export(self, version: int) -> None:
        """Asynchronous training: the learner's weights as of its calls so far become version `version`, exported
        for the requests that will sample with it, with the learner's fingerprints of them and its probe sample
        (`Learner.probe_sample`, which the requests that load the version hand their engine to score), asked for now:
        the learner computes them before its next update."""
        self.weights_version = version
        fingerprints = self.fleet.learner.weights_fingerprint.remote() if self.config.sync.fingerprint else None
        probe = None
        if self.config.sync.probe and self.probe_prompt is not None:
            cfg = self.config
            args = (self.probe_prompt, cfg.sync.probe_tokens, cfg.rollout.temperature, PROBE_SEED)
            probe = self.fleet.learner_group.submit("probe_sample", args)[0]  # rank 0's (every rank must join)
        export = self.exports[version] = Export(version, self.transport.export(version), fingerprints, probe)
        if self.in_flight:
            for slot in self.fleet.rollout:
                self.offers.append((slot, slot.actor.offer_weights.options(concurrency_group="weights").remote(
                    version, export.probe, *export.load[1:])))

    def restored(self, version: int) -> None:
        """Asynchronous training: the learner was restored to weights version `version` (nothing in flight); every
        worker's next request loads it (and runs the probe), as after the drain the checkpoint was written at."""
        self.weights_version = version
        self.serving = {}

    def dispatch(self, prompts: list[str | Any], seeds: list[int], sampling: Any, version: int) -> Batch:
        """Asynchronous training: queue a batch on the workers (split as `generate` splits one), to be sampled with
        weights version `version` (exported by `export`; a worker whose previous request sampled another version
        loads it first, and runs the probe after). Returns at once; `collect` waits for it."""
        shares = self._shares(len(prompts))
        starts = [sum(shares[:i]) for i in range(len(shares) + 1)]
        batch = Batch(prompts, seeds, sampling, version)
        for i, slot in enumerate(self.fleet.rollout):
            if shares[i]:
                batch.requests.append(Request(batch, slot, (starts[i], starts[i + 1])))
                self._submit(batch.requests[-1])
        return batch

    def _submit(self, request: Request) -> None:
        """Send `request` to its slot's worker, behind the requests it already holds."""
        batch, slot = request.batch, request.slot
        queue = self.queues.setdefault(slot.id, deque())
        request.load = self.serving.get(slot.id) != batch.version
        export = self.exports[batch.version]
        load = export.load if request.load else []
        kwargs = {"score_probe": export.probe} if request.load and export.probe is not None else {}
        if self.in_flight:
            kwargs["in_flight"] = True
        a, b = request.chunk
        request.ref = slot.actor.generate.remote(batch.prompts[a:b], batch.seeds[a:b], batch.sampling, *load,
                                                 **kwargs)
        request.started = None if queue else time.monotonic()
        request.result = None
        queue.append(request)
        self.serving[slot.id] = batch.version

    def collect(self, batch: Batch) -> list[list[Any]]:
        """Wait for `batch` ([prompts][G] rollouts in prompt order), replacing workers that die or miss
        `timeouts.generate` (counted from when a request reached the front of its worker's queue): the replacement
        runs every request the worker held again, in order, each loading its version first, with the same seeds.
        Every load is checked (version, fingerprints, probe) before this returns, and every rollout's version."""
        timeout = self.config.timeouts.generate
        while any(r.result is None or not r.result.ok for r in batch.requests):
            waiting = [r for queue in self.queues.values() for r in queue]
            first_deadline = min(q[0].started for q in self.queues.values() if q) + timeout
            ray.wait([r.ref for r in waiting], num_returns=1, timeout=max(0.0, first_deadline - time.monotonic()))
            ready = set(ray.wait([r.ref for r in waiting], num_returns=len(waiting), timeout=0)[0])
            now = time.monotonic()
            failed: dict[int, str] = {}  # slot id -> cause
            for slot_id, queue in self.queues.items():
                while queue and queue[0].ref in ready:  # a worker runs its requests in order
                    request = queue[0]
                    [request.result] = settle([request.ref], "generate")
                    if not request.result.ok:
                        failed[slot_id] = request.result.error
                        break
                    queue.popleft()
                    a, b = request.chunk
                    self._record_speed(slot_id, b - a, now - request.started)
                    self._note_clock(slot_id, request.result.value)
                    if queue:
                        queue[0].started = now
                if slot_id not in failed and queue and queue[0].started + timeout <= now:
                    failed[slot_id] = late(timeout, "generate")
            if any(r.load for sid in failed for r in self.queues[sid]):
                self.transport.check_learner()  # a dead learner fails every request that loads its weights
            for slot_id, cause in failed.items():
                self._restart_queue(slot_id, cause)
        self._settle_offers()
        self._check_batch(batch)
        # Kept: versions requests in flight may load again, this batch's (dynamic sampling's extra rounds) and the
        # newest (the next batches); the rest cannot be asked for again.
        in_flight = {r.batch.version for queue in self.queues.values() for r in queue}
        oldest = min(in_flight | {batch.version, max(self.exports)})
        self.exports = {v: e for v, e in self.exports.items() if v >= oldest}
        groups = [group for r in sorted(batch.requests, key=lambda r: r.chunk) for group in r.result.value]
        if self.in_flight:  # each token: the batch's version or a newer one the worker loaded (`_check_batch`)
            versions = np.concatenate([np.asarray(r.versions, np.int64) for g in groups for r in g] or [[]])
            if versions.size and not batch.version <= versions.min() <= versions.max() <= max(self.exports):
                raise SyncError(f"tokens came from weights versions {versions.min()}..{versions.max()}, but the batch "
                                f"was to be sampled with {batch.version} or a newer exported version: a worker missed "
                                "a load")
            return groups
        stale = {r.weights_version for g in groups for r in g} - {batch.version}
        if stale:
            raise SyncError(f"rollouts came from weights version {sorted(stale)} but the batch was to be sampled with "
                            f"{batch.version}: a worker missed a load")
        return groups

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

    def _check_batch(self, batch: Batch) -> None:
        """Check the loads `batch`'s requests made (workers in order) and the probes they ran: each load against the
        learner's fingerprints of its version, each probe against the learner's probe sample of that version.
        A request loads the batch's version first when its worker's previous request sampled another; with in-flight
        updates it reports every load it made (at its start, the newest of its own version and the offered ones,
        probed at once; during it, each newer offer, the last one probed after the request)."""
        checks = []
        for request in batch.requests:
            value, slot = request.result.value, request.slot
            if self.in_flight:
                if value.loads is None:
                    raise SyncError(f"{slot.name} returned no report of its in-flight loads "
                                    "(rollout.in_flight_updates)")
                loads = value.loads
            else:
                loads = [(value.loaded, value.probe, False)] if request.load else []
            if loads:
                self.unprobed.add(slot.id)
            for loaded, sample, during in loads:
                version = getattr(loaded, "version", None) if self.in_flight else batch.version
                if version not in self.exports:
                    raise SyncError(f"weight sync check failed: {slot.name} reports a load of weights version "
                                    f"{version}, which is not one the learner exported for it")
                expected = self.fingerprints_of(version) if self.config.sync.fingerprint else None
                check_loaded(slot.name, loaded, version, expected)
                self.in_flight_loads += during
                if sample is not None:  # it carries the learner's logprobs, from the export
                    weights = digest(expected) if expected is not None else f"version {version}"
                    checks.append((slot, probe_gap(sample), sample, weights))
                elif not during and self.exports[version].probe is not None:
                    raise SyncError(f"weight sync check failed: {slot.name} (version {version}) was asked to run the "
                                    "probe with its request but returned none")
        if checks:
            self._check_probes(checks)

    def take_in_flight_loads(self) -> int:
        """Loads the engines made during a request since the last call (in-flight updates)."""
        loads, self.in_flight_loads = self.in_flight_loads, 0
        return loads

    def _restart_queue(self, slot_id: int, cause: str) -> None:
        """Replace the worker of slot `slot_id` and send it every request the old one held, in order."""
        index = next(i for i, slot in enumerate(self.fleet.rollout) if slot.id == slot_id)
        self._restart(index, cause)
        requests = list(self.queues.pop(slot_id))
        self.serving.pop(slot_id, None)  # a new engine: each request loads its version
        self.clock_end.pop(slot_id, None)
        for request in requests:
            self._submit(request)

    def resize(self, num_workers: int, remove_ids: list[int] = ()) -> None:
        """Between steps: stop the workers `remove_ids` (serving or pending), then drop workers (pending ones first,
        then serving ones, newest first) or ask Ray for new ones until the fleet and the workers on their way into it
        number `num_workers`. New workers are only placed here; `admit` starts them and adds them once they are up."""
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
        if removed:
            fleet.rollout = [slot for slot in fleet.rollout if slot not in removed]
            moved = []  # asynchronous training: requests the removed workers still held go to the others
            for slot in removed:
                self.deferred.pop(slot.id, None)
                moved += self.queues.pop(slot.id, ())
                self.serving.pop(slot.id, None)
            fleet.launcher.stop(removed)
            self.transport.fleet_changed(self.workers)
            self.scale_events += len(removed)
            for n, request in enumerate(moved):  # each loads its version on its new worker (`_submit`)
                request.slot = fleet.rollout[n % len(fleet.rollout)]
                self._submit(request)
        busy = [slot.node_id for slot in fleet.rollout]
        for _ in range(num_workers - len(fleet.rollout) - len(fleet.pending)):
            placement = fleet.launcher.place(busy)
            fleet.pending.append(PendingWorker(self.next_id, placement, placement.ready(), time.monotonic()))
            self.next_id += 1

    def admit(self) -> int:
        """At a step boundary (nothing in flight): start the engines of pending workers that Ray has placed, and add
        every pending worker whose engine is up to the fleet, loaded with the current weights and probe-checked before
        its first request; returns how many joined. A worker whose engine fails to start, is not up within
        `timeouts.start` of its start, or fails its load is dropped, counted in `scale_failures` and named in
        `last_scale_error`; the run goes on with the fleet it has. Waits for neither placement nor start-up."""
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
        first = len(fleet.rollout)
        fleet.rollout += [RolloutSlot(p.id, p.actor, p.placement, node_of(p.placement)) for p in joining]
        self.transport.fleet_changed(self.workers)
        lost = {fleet.rollout[i].id: cause for i, cause in self._load(list(range(first, len(fleet.rollout)))).items()}
        if lost:
            self._drop_new([slot for slot in fleet.rollout if slot.id in lost], lost, "while loading the weights")
            fleet.rollout = [slot for slot in fleet.rollout if slot.id not in lost]
            self.transport.fleet_changed(self.workers)
        if self.config.sync.probe and len(fleet.rollout) > first:
            self.verify(list(range(first, len(fleet.rollout))))
        self.scale_events += len(fleet.rollout) - first
        return len(fleet.rollout) - first

    def _drop_new(self, workers: list[PendingWorker] | list[RolloutSlot], causes: dict[int, str],
                  when: str = "") -> None:
        """Stop new workers that failed on their way into the fleet, counting and reporting each."""
        if not workers:
            return
        self.fleet.launcher.stop(workers, timeout=0)
        for worker in workers:
            self.scale_failures += 1
            self.last_scale_error = f"new {worker.name} {causes[worker.id]}{' ' + when if when else ''}"
            print(f"relay: {self.last_scale_error}; it was dropped, the run goes on with the workers it has",
                  file=sys.stderr, flush=True)

    def sync(self, version: int, now: bool = False) -> None:
        """Load the learner's weights (version `version`) into every worker and verify them (the probe's gaps go to
        `take_gap`).

        With a transport that allows it (`object_store`), and unless `now`, the weights are only exported here:
        every worker loads them at the start of its next `generate` request, which Ray runs after any earlier call
        from this driver, runs the probe right after the load (`sync.probe`), and the request's result carries both
        back; `generate` checks them before it returns, so nothing is trained on rollouts of unverified weights, and
        every rollout's weights version is still checked. `now` loads and probes at once (the end of a run)."""
        self.weights_version = version
        if self.config.sync.fingerprint:  # computed by the learner while the workers load
            self.expected = (version, self.fleet.learner.weights_fingerprint.remote())
        loads = None if now else self.transport.defer({slot.id: slot for slot in self.fleet.rollout}, version)
        if loads is not None:
            self.deferred = loads
            return
        self.deferred = {}
        failed = self._load(list(range(len(self.workers))))
        for i, cause in failed.items():
            self.replace(i, cause)  # the replacement is loaded and probed on its own
        if self.config.sync.probe:
            self.verify()

    def take_gap(self) -> float:
        """The largest probe gap since the last call (the sync's probes and any new or replaced worker's); NaN when
        nothing was probed."""
        gaps, self.gaps = self.gaps, []
        return max(gaps, default=float("nan"))

    def probe_args(self) -> tuple:
        """The arguments of `RolloutWorker.probe`: the same seeded sample every time."""
        cfg = self.config
        return cfg.sync.probe_prompt, cfg.sync.probe_tokens, cfg.rollout.temperature, PROBE_SEED

    def verify(self, indices: list[int] | None = None, samples: dict[int, ProbeSample] | None = None) -> float:
        """Compare engines' logprobs of a seeded probe sample with the learner's; return the largest gap, or raise
        SyncError naming the first worker whose gap exceeds `sync.probe_tolerance`, whose first probe since its last
        load took prompt tokens from the prefix cache (KV entries of the previous weights survived the load: a stale
        cache changes logprobs by as little as the last step changed the weights, less than the tolerance), or whose
        probe is bit for bit the one it gave at an earlier version while the learner's logprobs of it moved by more
        than the noise floor (`stale_probe`: the engine did not apply the load; in bfloat16, where the noise floor
        hides a step's change from the gap, this still sees it).

        The first call (before any update, the engines on the weights the learner started from) measures the noise
        floor; without `sync.probe_tolerance` it sets the tolerance from it (`probe_tolerance_from`). `samples`: the
        probes the workers already ran (by index), else they are asked for them now."""
        return self.check_probes(self.score_probes(indices, samples))

    def score_probes(self, indices: list[int] | None = None, samples: dict[int, ProbeSample] | None = None
                     ) -> Probes:
        """`verify`'s first half: the probes (`samples`, else run now) sent to the learner to score, not waited
        for; `check_probes` finishes it."""
        indices = list(range(len(self.workers))) if indices is None else indices
        if samples is not None:
            probes = [samples[i] for i in indices]
        else:
            names = [self.fleet.rollout_names[i] for i in indices]
            probes = values(call_all([self.workers[i] for i in indices], "probe", self.probe_args(),
                                     self.config.timeouts.sync, "sync", stop_on_failure=True), names, "sync")
        # The learner scores each distinct sample alone, so that its logprobs of the same tokens and weights are the
        # same bits whichever other samples the probe had (batched, padding changes them in bfloat16).
        asked: dict[tuple, list[Any]] = {}
        for p in probes:
            key = _sample_key(p)
            if key not in asked:
                asked[key] = self.fleet.learner_group.submit("compute_logprobs", ([p.prompt_ids], [p.response_ids]))
            self.probe_prompt = list(p.prompt_ids)
        return Probes([self.fleet.rollout[i] for i in indices], probes, asked, time.monotonic())

    def check_probes(self, probes: Probes) -> float:
        """`verify`'s second half: the probes' gaps to the learner's logprobs and `verify`'s rules; returns the
        largest gap."""
        weights = self._weights_digest()
        return self._check_probes([(slot, probe_gap(sample), sample, weights)
                                   for slot, sample in zip(probes.slots, self._scored(probes))])

    def _scored(self, probes: Probes) -> list[ProbeSample]:
        """The probes with the learner's logprobs filled in, waited for within `timeouts.sync` of when
        `score_probes` asked."""
        learner_group, timeout = self.fleet.learner_group, self.config.timeouts.sync
        scored = {key: learner_group.finish(refs, max(0.0, timeout - (time.monotonic() - probes.since)), "sync")[0][0]
                  for key, refs in probes.asked.items()}
        return [p._replace(learner_logprobs=scored[_sample_key(p)]) for p in probes.samples]

    def _check_probes(self, checks: list[tuple[RolloutSlot, float, ProbeSample, str]]) -> float:
        """`verify`'s rules over (worker, gap, probe with the learner's logprobs, what identifies the learner's
        weights it was compared with) of each probe; returns the largest gap."""
        if self.noise is None:
            self.noise = max((gap for _, gap, _, _ in checks), default=0.0)
        if self.tolerance is None:
            dtype = self.config.model.dtype
            self.tolerance = probe_tolerance_from(self.noise, self.fleet.rollout_names, dtype)
            print(f"relay: sync probe tolerance {self.tolerance:.3g} (5x the engine-learner noise floor, at least "
                  f"{probe_tolerance_min(dtype):g} in {dtype})", file=sys.stderr, flush=True)
        tolerance = self.tolerance
        for slot, gap, sample, weights in checks:
            name, version, slot_id = slot.name, sample.weights_version, slot.id
            self.probe_sample = (list(sample.prompt_ids), list(sample.response_ids))
            if not gap <= tolerance:
                raise SyncError(
                    f"weight sync check failed: {name} (version {version}) gives probe logprobs that differ from the "
                    f"learner's by {gap:.3g} > the probe tolerance {tolerance:.3g} ({self._tolerance_source()}); the "
                    "engine is not serving the learner's weights")
            if slot_id in self.unprobed and sample.cached_prompt_tokens:
                raise SyncError(
                    f"weight sync check failed: {name} (version {version}) took {sample.cached_prompt_tokens} probe "
                    "prompt tokens from its prefix cache right after a load, so KV entries computed with the previous "
                    "weights survived it (the engine's prefix cache was not reset)")
            self.unprobed.discard(slot_id)
            record = ProbeRecord(version, weights, tuple(sample.response_ids), tuple(sample.logprobs),
                                 tuple(sample.learner_logprobs))
            moved = stale_probe(self.probes.get(slot_id), record, self.noise)
            if moved is not None:
                earlier = self.probes[slot_id].version
                raise SyncError(
                    f"weight sync check failed: {name} (version {version}) gives bit for bit the probe logprobs it "
                    f"gave at version {earlier}, while the learner's logprobs of the same tokens moved by {moved:.3g} "
                    f"(more than the noise floor {self.noise:.3g}) since: the engine did not apply the loads after "
                    f"version {earlier}")
            self.probes[slot_id] = next_probe_record(self.probes.get(slot_id), record)
        largest = max((gap for _, gap, _, _ in checks), default=0.0)
        self.gaps.append(largest)
        return largest

    def _weights_digest(self) -> str:
        """What identifies the learner's current weights: the digest of its fingerprints, or without them the
        version."""
        if not self.config.sync.fingerprint:
            return f"version {self.weights_version}"
        return digest(self.learner_fingerprint())

    def learner_fingerprint(self) -> dict[str, str]:
        """The learner's fingerprints of its current weights (version `weights_version`), asked once per version."""
        return self.fingerprints_of(self.weights_version)

    def fingerprints_of(self, version: int) -> dict[str, str]:
        """The learner's fingerprints of weights `version`: the current version's (asked for by `sync`, or now), or
        an exported version's (asked for by `export`), read once."""
        export = self.exports.get(version)
        if export is not None and export.fingerprints is not None:
            export.fingerprints = self._read(export.fingerprints)
            return export.fingerprints
        if version != self.weights_version:
            raise RuntimeError(f"the learner's fingerprints of weights version {version} were not asked for when it "
                               f"had them (it is at {self.weights_version})")
        if self.expected is None or self.expected[0] != version:
            self.expected = (version, self.fleet.learner.weights_fingerprint.remote())
        self.expected = (version, self._read(self.expected[1]))
        return self.expected[1]

    def _read(self, value: Any) -> Any:
        """`value`, or what the learner returns for it when it is a ref (`timeouts.sync`)."""
        if isinstance(value, ray.ObjectRef):
            [value] = get([value], self.config.timeouts.sync, ["learner"], "sync")
        return value

    def check_loaded(self, index: int, loaded: Loaded | None) -> None:
        """Raise SyncError unless worker `index` reports a load of the current version and (`sync.fingerprint`)
        handed its engine exactly the learner's weights, in every engine process that received them."""
        expected = self.learner_fingerprint() if self.config.sync.fingerprint else None
        check_loaded(self.fleet.rollout_names[index], loaded, self.weights_version, expected)

    def _tolerance_source(self) -> str:
        if self.config.sync.probe_tolerance is not None:
            return "sync.probe_tolerance"
        return "derived from the noise floor before the first update; set sync.probe_tolerance to override"

    def probe_gaps(self, indices: list[int]) -> list[tuple[float, ProbeSample]]:
        """Per worker (by index): (largest |engine - learner| logprob over a seeded probe sample run now, the sample
        with the learner's logprobs filled in), without `verify`'s rules (bench/weight_sync.py's stale gap)."""
        return [(probe_gap(s), s) for s in self._scored(self.score_probes(indices))]

    def replace(self, index: int, cause: str) -> None:
        """Kill worker `index`, start a new one in its bundle, load the current weights and probe them."""
        self._restart(index, cause)  # counts its own time in `recovery_seconds`
        started = time.perf_counter()
        failed = self._load([index])
        if failed:
            raise RunError(f"{self.fleet.rollout_names[index]} was replaced after it {cause}, but its replacement "
                           f"{failed[index]} while loading the weights")
        if self.config.sync.probe:
            self.verify([index])
        self.recovery_seconds += time.perf_counter() - started

    def _restart(self, index: int, cause: str) -> None:
        """Kill worker `index` and start a new one in its bundle (counted against `rollout.max_restarts`); the new
        engine serves the model's own weights until it loads others."""
        name = self.fleet.rollout_names[index]
        limit = self.config.rollout.max_restarts
        if self.restarts >= limit:
            raise RunError(f"{name} {cause}, and {self.restarts} rollout workers were already replaced "
                           f"(rollout.max_restarts={limit}); the engines keep failing, check the Ray logs")
        started = time.perf_counter()
        self.restarts += 1
        print(f"relay: {name} {cause}; replacing it", file=sys.stderr, flush=True)
        slot = self.fleet.rollout[index]
        self.deferred.pop(slot.id, None)  # the replacement is loaded (and probed) by the caller
        ray.kill(slot.actor, no_restart=True)
        slot.actor = self.fleet.launcher.start(slot.placement)
        self.transport.fleet_changed(self.workers)
        get([self.workers[index].__ray_ready__.remote()], self.config.timeouts.start, [name], "start")
        self.recovery_seconds += time.perf_counter() - started

    def _load(self, indices: list[int]) -> dict[int, str]:
        """Load the learner's current weights into the given workers through the configured transport; returns
        {index: cause} of the workers that died, raised or missed the deadline."""
        done, failed = self.transport.load({i: self.fleet.rollout[i] for i in indices}, self.weights_version)
        self.unprobed.update(self.fleet.rollout[i].id for i in done)
        self.serving.update((self.fleet.rollout[i].id, self.weights_version) for i in done)
        for i, loaded in done.items():
            self.check_loaded(i, loaded)
        return failed


def _sample_key(sample: ProbeSample) -> tuple:
    """What makes two probe samples the same for the learner to score: their tokens."""
    return tuple(sample.prompt_ids), tuple(sample.response_ids)


def probe_gap(sample: ProbeSample) -> float:
    """The largest |engine - learner| logprob over a probe sample's tokens."""
    return max((abs(a - b) for a, b in zip(sample.logprobs, sample.learner_logprobs)), default=0.0)
