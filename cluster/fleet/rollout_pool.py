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
from typing import TYPE_CHECKING, Any

import ray

from cluster.config import RunConfig
from cluster.fleet.placement import Fleet, PendingWorker, RolloutSlot, node_of
from sync.calls import RunError, call_all, get, late, settle, values
from sync.fingerprint import digest
from sync.transport import make_transport
from sync.verify import (
    PROBE_SEED,
    PROBE_TOLERANCE_MIN,
    ProbeRecord,
    SyncError,
    check_loaded,
    next_probe_record,
    probe_tolerance_from,
    stale_probe,
)

if TYPE_CHECKING:
    from actors.rollout import ProbeSample
    from sync.receive import Loaded


SPEED_BAND = 0.1  # relative speed differences treated as noise by `rollout.balance=speed`


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
        self.expected: tuple[int, Any] | None = None  # (version, the learner's fingerprints of it, or their ref)

    @property
    def workers(self) -> list[Any]:
        return self.fleet.rollout_workers

    def generate(self, prompts: list[str | Any], seeds: list[int], sampling: Any) -> list[list[Any]]:
        """[prompts][G] rollouts in prompt order, each prompt (text, or its token ids) sampled with its own seed (so
        the result does not depend on which worker serves a prompt).

        Each worker gets one request per step (one engine batch), sized by `rollout.balance`: with `speed`, in
        proportion to the prompts per second it managed in recent steps, so a slow worker gets fewer prompts and
        the fleet finishes together. A request whose worker dies or misses `timeouts.generate` goes to the worker's
        replacement."""
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
                    self._record_speed(worker, b - a, now - started)
                    slot_id = self.fleet.rollout[worker].id
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
            self.verify(sorted(probed), probed)
        groups = [group for start in sorted(results) for group in results[start]]
        stale = {r.weights_version for g in groups for r in g} - {self.weights_version}
        if stale:
            raise SyncError(f"rollouts came from weights version {sorted(stale)} but the learner is at "
                            f"{self.weights_version}: a worker missed a sync")
        return groups

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

    def _record_speed(self, worker: int, prompts: int, seconds: float) -> None:
        """Prompts per second of worker `worker`'s last request, averaged over steps (half-life of one step)."""
        slot_id = self.fleet.rollout[worker].id
        rate = prompts / max(seconds, 1e-6)
        self.speeds[slot_id] = rate if slot_id not in self.speeds else 0.5 * self.speeds[slot_id] + 0.5 * rate

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
            for slot in removed:
                self.deferred.pop(slot.id, None)
            fleet.launcher.stop(removed)
            self.transport.fleet_changed(self.workers)
            self.scale_events += len(removed)
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
        indices = list(range(len(self.workers))) if indices is None else indices
        gaps = self.probe_gaps(indices, samples)
        if self.noise is None:
            self.noise = max((gap for gap, _ in gaps), default=0.0)
        if self.tolerance is None:
            self.tolerance = probe_tolerance_from(self.noise, self.fleet.rollout_names)
            print(f"relay: sync probe tolerance {self.tolerance:.3g} (5x the engine-learner noise floor, at least "
                  f"{PROBE_TOLERANCE_MIN:g})", file=sys.stderr, flush=True)
        tolerance = self.tolerance
        weights = self._weights_digest()
        for i, (gap, sample) in zip(indices, gaps):
            name, version, slot_id = self.fleet.rollout_names[i], sample.weights_version, self.fleet.rollout[i].id
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
        largest = max((gap for gap, _ in gaps), default=0.0)
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
        if self.expected is None or self.expected[0] != self.weights_version:
            self.expected = (self.weights_version, self.fleet.learner.weights_fingerprint.remote())
        if isinstance(self.expected[1], ray.ObjectRef):  # asked for by `sync`
            [fingerprints] = get([self.expected[1]], self.config.timeouts.sync, ["learner"], "sync")
            self.expected = (self.weights_version, fingerprints)
        return self.expected[1]

    def check_loaded(self, index: int, loaded: Loaded | None) -> None:
        """Raise SyncError unless worker `index` reports a load of the current version and (`sync.fingerprint`)
        handed its engine exactly the learner's weights, in every engine process that received them."""
        expected = self.learner_fingerprint() if self.config.sync.fingerprint else None
        check_loaded(self.fleet.rollout_names[index], loaded, self.weights_version, expected)

    def _tolerance_source(self) -> str:
        if self.config.sync.probe_tolerance is not None:
            return "sync.probe_tolerance"
        return "derived from the noise floor before the first update; set sync.probe_tolerance to override"

    def probe_gaps(self, indices: list[int], samples: dict[int, ProbeSample] | None = None
                   ) -> list[tuple[float, ProbeSample]]:
        """Per worker: (largest |engine - learner| logprob over a seeded probe sample, the sample with the
        learner's logprobs filled in); `samples` (by index) are probes the workers already ran.

        The learner scores each distinct sample alone, so that its logprobs of the same tokens and weights are the
        same bits whichever other samples the probe had (batched, padding changes them in bfloat16)."""
        if samples is not None:
            probes = [samples[i] for i in indices]
        else:
            names = [self.fleet.rollout_names[i] for i in indices]
            probes = values(call_all([self.workers[i] for i in indices], "probe", self.probe_args(),
                                     self.config.timeouts.sync, "sync", stop_on_failure=True), names, "sync")
        learner_lps: dict[tuple, list[float]] = {}
        samples = []
        for p in probes:
            key = (tuple(p.prompt_ids), tuple(p.response_ids))
            if key not in learner_lps:
                [learner_lps[key]] = self.fleet.learner_group.compute_logprobs([p.prompt_ids], [p.response_ids])
            samples.append(p._replace(learner_logprobs=learner_lps[key]))
        return [(max((abs(a - b) for a, b in zip(s.logprobs, s.learner_logprobs)), default=0.0), s) for s in samples]

    def replace(self, index: int, cause: str) -> None:
        """Kill worker `index`, start a new one in its bundle, load the current weights and probe them."""
        name = self.fleet.rollout_names[index]
        limit = self.config.rollout.max_restarts
        if self.restarts >= limit:
            raise RunError(f"{name} {cause}, and {self.restarts} rollout workers were already replaced "
                           f"(rollout.max_restarts={limit}); the engines keep failing, check the Ray logs")
        started = time.perf_counter()
        self.restarts += 1
        slot = self.fleet.rollout[index]
        self.deferred.pop(slot.id, None)  # the replacement is loaded (and probed) here
        ray.kill(slot.actor, no_restart=True)
        slot.actor = self.fleet.launcher.start(slot.placement)
        self.transport.fleet_changed(self.workers)
        get([self.workers[index].__ray_ready__.remote()], self.config.timeouts.start, [name], "start")
        failed = self._load([index])
        if failed:
            raise RunError(f"{name} was replaced after it {cause}, but its replacement {failed[index]} while loading "
                           "the weights")
        if self.config.sync.probe:
            self.verify([index])
        self.recovery_seconds += time.perf_counter() - started

    def _load(self, indices: list[int]) -> dict[int, str]:
        """Load the learner's current weights into the given workers through the configured transport; returns
        {index: cause} of the workers that died, raised or missed the deadline."""
        done, failed = self.transport.load({i: self.fleet.rollout[i] for i in indices}, self.weights_version)
        self.unprobed.update(self.fleet.rollout[i].id for i in done)
        for i, loaded in done.items():
            self.check_loaded(i, loaded)
        return failed

