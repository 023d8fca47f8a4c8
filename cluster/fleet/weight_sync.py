"""The run's verified weight sync: what each weights version is, and whether every engine serves exactly it.

Owns: exporting the learner's weights as a version (`export`: the load arguments a request carries, when they were
ready, the learner's fingerprints of them, and the probe that the loading engine runs or scores), loading them into
workers at once (`load_now`), and the checks, by sync/verify.py's rules: each load against the learner's fingerprints
of its version, each probe against the learner's logprobs within the tolerance (set from the noise floor the first
probe measures), the prefix cache emptied by a load, an engine that silently kept its old weights. It reports the
workers whose load failed and never calls back into the pool, which replaces them.
Does not own: which worker runs what (cluster/fleet/rollout_pool.py), moving the bytes (sync/transport.py), the rules
themselves (sync/verify.py).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from actors.rollout_types import SampleProbe
from cluster.config import RunConfig
from cluster.fleet.placement import Fleet, RolloutSlot
from sync.calls import RunError, call_all, get, time_left, values
from sync.transport import make_transport
from sync.verify import (
    PROBE_NOISE_FACTOR,
    PROBE_NOISE_SEEDS,
    PROBE_SEED,
    ProbeRecord,
    SyncError,
    check_loaded,
    digest,
    next_probe_record,
    probe_gap,
    probe_noise,
    probe_tolerance_from,
    probe_tolerance_min,
    stale_probe,
)

if TYPE_CHECKING:
    from actors.rollout import ProbeSample
    from cluster.fleet.workers import RolloutWorkers
    from sync.receive import Loaded


class Ready:
    """When every one of some refs resolved (`at`, time.monotonic(); None until then), told by Ray's callbacks: the
    clock of a request that loads weights starts when they exist, not when the driver last looked."""

    def __init__(self, refs: list[Any]):
        self.refs = refs
        self.at: float | None = None if refs else time.monotonic()
        self._left = len(refs)
        self._lock = threading.Lock()
        for ref in refs:
            ref.future().add_done_callback(self._one_done)

    def _one_done(self, _: Any) -> None:
        with self._lock:
            self._left -= 1
            if not self._left:
                self.at = time.monotonic()


@dataclass(eq=False)
class Export:
    """One weights version the learner exported, kept while requests that sample with it may still run (a replaced
    worker loads it again)."""

    version: int
    loads: dict[int, list]  # slot id -> `[version, *refs]` (RolloutWorker.generate's load arguments), by worker
    default: list | None  # the load arguments of any other worker (object-store buckets), or None
    fingerprints: Any  # the learner's fingerprints of it (a ref until read), with `sync.fingerprint`
    probe: Any  # what a loading request's engine runs as the probe (`RolloutWorker.generate`'s `probe`), or None
    ready: Ready  # when the weights were exported (the learner exports them after the update it runs)
    asked: float  # time.monotonic() when the export was asked for

    def load_args(self, slot_id: int) -> list:
        args = self.loads.get(slot_id, self.default)
        if args is None:
            raise RuntimeError(f"weights version {self.version} was exported for workers {sorted(self.loads)} only, "
                               f"not for worker {slot_id}")
        return args


class EngineSampledProbe:
    """The probe while one version is in flight (`rollout.max_staleness` = 0): the loading engine samples the seeded
    probe (in its request's own engine batch where it is batch-invariant) and the learner, which still holds that
    version, scores the same tokens while the driver scores the rollouts; checked before the update goes out."""

    def __init__(self, sync: WeightSync):
        self.sync = sync

    def ask(self) -> SampleProbe:
        return SampleProbe(*self.sync.probe_args())

    def draws(self, slots: list[RolloutSlot], seeds: tuple[int, ...]) -> list[list[ProbeSample]]:
        """Every engine samples each seed's probe, then the learner scores them all."""
        asked = [self.sync.score_probes(slots, self.sync.engine_probes(slots, seed)) for seed in seeds]
        return [self.sync.scored(probes) for probes in asked]


class LearnerSampledProbe:
    """The probe while several versions are in flight: the learner has moved on when an engine loads a version, so
    it samples the probe itself when it exports the version, and the loading engine scores those tokens."""

    def __init__(self, sync: WeightSync):
        self.sync = sync

    def ask(self) -> Any:
        """Rank 0's ref of the learner's probe sample of the weights exported now (every rank must join); None before
        any worker told the probe prompt's tokens."""
        if self.sync.probe_prompt is None:
            return None
        return self.sync.fleet.learner_group.submit("probe_sample", self.sync.learner_probe_args(PROBE_SEED))[0]

    def draws(self, slots: list[RolloutSlot], seeds: tuple[int, ...]) -> list[list[ProbeSample]]:
        return [self.sync.learner_probes(slots, seed) for seed in seeds]


@dataclass(eq=False)
class Probes:
    """Probe samples sent to the learner to score (`WeightSync.score_probes`), to be checked (`check_pending`)."""

    slots: list[RolloutSlot]  # the workers that ran them, in order
    samples: list[ProbeSample]
    asked: dict[tuple, list[Any]]  # (prompt ids, response ids) -> the refs of every learner rank's logprobs of it
    since: float  # time.monotonic() when asked


class WeightSync:
    """The weights versions the learner exported and the checks of what the engines loaded; `version` is the newest."""

    def __init__(self, config: RunConfig, fleet: Fleet, workers: RolloutWorkers):
        self.config = config
        self.fleet = fleet  # read for the learner's actors only
        self.transport = make_transport(config.sync, fleet.learner, config.timeouts.sync)
        workers.watch(new_engine=lambda slot: self.unprobed.add(slot.id), changed=self.transport.fleet_changed)
        # Chosen once: with one version in flight (`max_staleness` = 0) loads may read the learner's shared-memory
        # buffer (rewritten by the next export) and the engines sample the probes; with several, every version's
        # buckets outlive the next export and the learner samples them (`export`, `verify`).
        one_version = not config.rollout.max_staleness
        self.probe = EngineSampledProbe(self) if one_version else LearnerSampledProbe(self)
        self.loads = self._deferred_loads if one_version else self._bucket_loads
        self.version = 0
        self.exports: dict[int, Export] = {}  # version -> its export, while requests may need it
        self.gaps: list[float] = []  # each check's largest (RMS) probe gap since `take_gap`
        # Slot ids of workers whose engine is new or loaded weights since it was last probed: its next probe must find
        # nothing of the probe's prompt in the prefix cache.
        self.unprobed: set[int] = {slot.id for slot in fleet.rollout}
        self.tolerance: float | None = config.sync.probe_tolerance  # or derived from the first probe's gaps
        self.noise: float | None = None  # the largest gap of the first probe's draws (`probe_noise`)
        self.records: dict[int, ProbeRecord] = {}  # slot id -> its engine's probe when its output last changed
        self.pending: list[Probes] = []  # probes the learner is scoring, checked by `check_pending`
        self.expected: tuple[int, Any] | None = None  # (version, the learner's fingerprints of it, or their ref)
        self.probe_prompt: list[int] | None = None  # the probe prompt's tokens, once a worker ran the probe
        self.probe_sample: tuple[list[int], list[int]] | None = None  # (prompt, response) of the latest probe checked

    def begin_sync(self, version: int) -> None:
        """The learner's current weights become version `version`, to be loaded into workers at once (`load_now`),
        their fingerprints asked for now (the learner computes them while the workers load)."""
        self.version = version
        if self.config.sync.fingerprint:
            self.expected = (version, self.fleet.learner.weights_fingerprint.remote())

    def restored(self, version: int) -> None:
        """The learner was restored to weights version `version`: the start's probe checked the model's weights, not
        the checkpoint's the next step samples with (that step's requests probe those), so its gap is let go: the next
        record's must match the uninterrupted run's."""
        self.version = version
        self.gaps = []

    def export(self, version: int, slots: list[RolloutSlot]) -> Export:
        """The learner's weights as of its calls so far become version `version`, with its fingerprints of them,
        asked for now (the learner answers after any update it runs), with what a loading request runs as the probe
        (`probe`, chosen at the start by how many versions may be in flight)."""
        cfg = self.config
        self.version = version
        fingerprints = self.fleet.learner.weights_fingerprint.remote() if cfg.sync.fingerprint else None
        asked = time.monotonic()
        loads, default = self.loads(version, slots)
        refs = {id(ref): ref for args in [*loads.values(), default or []] for ref in args[1:]}
        export = Export(version, loads, default, fingerprints, self.probe.ask() if cfg.sync.probe else None,
                        Ready(list(refs.values())), asked)
        self.exports[version] = export
        return export

    def _deferred_loads(self, version: int, slots: list[RolloutSlot]) -> tuple[dict[int, list], None]:
        """One version in flight: each worker's own load arguments (on the learner's node its shared-memory buffer)."""
        return self.transport.defer({slot.id: slot for slot in slots}, version), None

    def _bucket_loads(self, version: int, slots: list[RolloutSlot]) -> tuple[dict[int, list], list]:
        """Several versions in flight: object-store buckets any worker loads, kept while the export is."""
        return {}, self.transport.export(version)

    def check_export(self, export: Export) -> None:
        """After requests that load `export` failed: raise a RunError naming the learner if the export itself failed.
        Refs not resolved yet are not waited for: the learner may still be training (a worker's death during an
        update is the worker's)."""
        refs = export.ready.refs
        done = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
        get(done, self.config.timeouts.sync, ["learner"] * len(done), "sync")

    def export_deadline(self, export: Export) -> float:
        """When `export` must be ready: it may wait behind one update (`timeouts.train`), then has `timeouts.sync`."""
        return export.asked + self.config.timeouts.train + self.config.timeouts.sync

    def late_export(self, export: Export) -> RunError:
        return RunError(f"learner did not export weights version {export.version} within timeouts.train + "
                        f"timeouts.sync = {self.config.timeouts.train + self.config.timeouts.sync:g} s")

    def prune(self, keep_from: int) -> None:
        """Let go of the exports older than `keep_from` (no request can ask for them again)."""
        self.exports = {v: e for v, e in self.exports.items() if v >= keep_from}

    def load_now(self, slots: list[RolloutSlot]) -> tuple[list[RolloutSlot], dict[int, str]]:
        """Load the learner's current weights (`version`) into `slots` through the transport, each load checked:
        (the slots that loaded, {slot id: cause} of those that died, raised or missed the deadline)."""
        done, failed = self.transport.load({slot.id: slot for slot in slots}, self.version)
        by_id = {slot.id: slot for slot in slots}
        self.unprobed.update(done)
        for slot_id, loaded in done.items():
            self.check_loaded(by_id[slot_id], loaded, self.version)
        return [by_id[i] for i in done], failed

    # ------------------------------------------------------------------------------------------------ the checks

    def check_loads(self, loads: list[tuple[RolloutSlot, int, Loaded | None, ProbeSample | None, bool]],
                    probe_expected: list[bool]) -> int:
        """Check the loads a batch's requests made, in order: (worker, version it was sent, its report, the probe it
        ran or scored, whether it came during the request (in-flight updates)), `probe_expected` whether each was
        asked to run a probe. Probes the learner already scored (from the export) are checked now; those the engine
        sampled are sent to the learner to score, checked by `check_pending`. Returns the loads made during
        requests."""
        now, later, during_loads = [], {}, 0
        for (slot, version, loaded, sample, during), expect_probe in zip(loads, probe_expected):
            if version not in self.exports:
                raise SyncError(f"weight sync check failed: {slot.name} reports a load of weights version "
                                f"{version}, which is not one the learner exported for it")
            self.unprobed.add(slot.id)
            expected = self.check_loaded(slot, loaded, version)
            during_loads += during
            if sample is None:
                if not during and expect_probe:
                    raise SyncError(f"weight sync check failed: {slot.name} (version {version}) was asked to run the "
                                    "probe with its request but returned none")
            elif not len(sample.learner_logprobs):  # the engine sampled it: the learner scores it
                later[slot.id] = (slot, sample)
            else:  # it carries the learner's logprobs, from the export
                weights = digest(expected) if expected is not None else f"version {version}"
                now.append((slot, probe_gap(sample.logprobs, sample.learner_logprobs), sample, weights))
        if now:
            self._check_probes(now)
        if later:
            self.pending.append(self.score_probes([s for s, _ in later.values()], [p for _, p in later.values()]))
        return during_loads

    def check_loaded(self, slot: RolloutSlot, loaded: Loaded | None, version: int) -> dict[str, str] | None:
        """Raise SyncError unless `slot` reports a load of `version` and (`sync.fingerprint`) handed its engine
        exactly the learner's weights, in every engine process that received them; the learner's fingerprints."""
        expected = self.fingerprints_of(version) if self.config.sync.fingerprint else None
        check_loaded(slot.name, loaded, version, expected)
        return expected

    def check_pending(self) -> None:
        """Check the probes the learner was scoring (`verify`'s rules: SyncError if one fails)."""
        pending, self.pending = self.pending, []
        for probes in pending:
            self.check_probes(probes)

    def take_gap(self) -> float:
        """The largest probe gap since the last call; NaN when nothing was probed."""
        gaps, self.gaps = self.gaps, []
        return max(gaps, default=float("nan"))

    def probe_args(self, seed: int = PROBE_SEED) -> tuple:
        """The arguments of `RolloutWorker.probe`: the same seeded sample every time (other seeds: the noise draws)."""
        cfg = self.config
        return cfg.sync.probe_prompt, cfg.sync.probe_tokens, cfg.rollout.temperature, seed

    def verify(self, slots: list[RolloutSlot]) -> float:
        """Probe `slots` now and compare their logprobs with the learner's; return the largest gap, or raise SyncError
        naming the first worker whose gap exceeds the tolerance, whose first probe since its last load took prompt
        tokens from the prefix cache (KV entries of the previous weights survived the load: a stale cache changes
        logprobs by as little as the last step changed the weights, less than the tolerance), or whose probe is bit
        for bit the one it gave at an earlier version while the learner's logprobs of it moved by more than the noise
        floor (`stale_probe`: the engine did not apply the load; in bfloat16, where the noise floor hides a step's
        change from the gap, this still sees it).

        Every probe of a run is of one kind, so that all are compared at one temperature with the noise floor: on-policy
        each engine samples a seeded completion (at the sampling temperature) and the learner scores it; asynchronously
        the learner samples it from its current weights and each engine scores those tokens (prompt logprobs, at
        temperature 1), as the requests that load a version do. The first call (before any update, the engines on the
        weights the learner started from) measures the noise floor; without `sync.probe_tolerance` it sets the
        tolerance from it (`probe_tolerance_from`), from `PROBE_NOISE_SEEDS` draws (the rules then check the first,
        `PROBE_SEED`'s, as every later probe uses that seed)."""
        seeds = PROBE_NOISE_SEEDS if self.noise is None else (PROBE_SEED,)  # PROBE_SEED's first: the cache check's
        draws = self.probe.draws(slots, seeds)
        if self.noise is None:
            self.noise = probe_noise([(s.logprobs, s.learner_logprobs) for samples in draws for s in samples])
        weights = self.weights_digest()
        return self._check_probes([(slot, probe_gap(s.logprobs, s.learner_logprobs), s, weights)
                                   for slot, s in zip(slots, draws[0])])

    def engine_probes(self, slots: list[RolloutSlot], seed: int = PROBE_SEED) -> list[ProbeSample]:
        """Each worker's engine samples the seeded probe now (the learner scores it: `score_probes`)."""
        return values(call_all([slot.actor for slot in slots], "probe", self.probe_args(seed),
                               self.config.timeouts.sync, "sync", stop_on_failure=True), [slot.name for slot in slots],
                      "sync")

    def learner_probes(self, slots: list[RolloutSlot], seed: int) -> list[ProbeSample]:
        """The learner samples the seeded probe from its current weights now and each worker's engine scores the same
        tokens (asynchronous training's kind of probe); the samples carry both sides' logprobs. Only `PROBE_SEED`'s
        probe checks the prefix cache (the other draws of the noise floor find the prompt there)."""
        cfg, group = self.config, self.fleet.learner_group
        if self.probe_prompt is None:
            [self.probe_prompt] = get([slots[0].actor.tokenize.remote(cfg.sync.probe_prompt)], cfg.timeouts.sync,
                                      [slots[0].name], "sync")
        probe = group.finish(group.submit("probe_sample", self.learner_probe_args(seed)), cfg.timeouts.sync, "sync")[0]
        return values(call_all([slot.actor for slot in slots], "score_probe", (*probe, seed == PROBE_SEED),
                               cfg.timeouts.sync, "sync", stop_on_failure=True), [slot.name for slot in slots], "sync")

    def learner_probe_args(self, seed: int) -> tuple:
        """The arguments of `Learner.probe_sample`: the probe prompt's tokens, sampled as the engines sample it."""
        cfg = self.config
        return self.probe_prompt, cfg.sync.probe_tokens, cfg.rollout.temperature, seed

    def score_probes(self, slots: list[RolloutSlot], samples: list[ProbeSample]) -> Probes:
        """Send the engines' probe samples to the learner to score, not waited for (`check_probes` finishes)."""
        # The learner scores each distinct sample alone, so that its logprobs of the same tokens and weights are the
        # same bits whichever other samples the probe had (batched, padding changes them in bfloat16).
        asked: dict[tuple, list[Any]] = {}
        for p in samples:
            key = _sample_key(p)
            if key not in asked:
                asked[key] = self.fleet.learner_group.submit("compute_logprobs", ([p.prompt_ids], [p.response_ids]))
            self.probe_prompt = list(p.prompt_ids)
        return Probes(slots, samples, asked, time.monotonic())

    def check_probes(self, probes: Probes) -> float:
        """The probes' gaps to the learner's logprobs and `verify`'s rules; returns the largest gap."""
        weights = self.weights_digest()
        return self._check_probes([(slot, probe_gap(sample.logprobs, sample.learner_logprobs), sample, weights)
                                   for slot, sample in zip(probes.slots, self.scored(probes))])

    def scored(self, probes: Probes) -> list[ProbeSample]:
        """The probes with the learner's logprobs filled in, waited for within `timeouts.sync` of when asked."""
        learner_group, timeout = self.fleet.learner_group, self.config.timeouts.sync
        scored = {key: learner_group.finish(refs, time_left(timeout, probes.since), "sync")[0][0]
                  for key, refs in probes.asked.items()}
        return [p._replace(learner_logprobs=scored[_sample_key(p)]) for p in probes.samples]

    def _check_probes(self, checks: list[tuple[RolloutSlot, float, ProbeSample, str]]) -> float:
        """`verify`'s rules over (worker, gap, probe with the learner's logprobs, what identifies the learner's
        weights it was compared with) of each probe; returns the largest gap."""
        if self.noise is None:
            self.noise = probe_noise([(sample.logprobs, sample.learner_logprobs) for _, _, sample, _ in checks])
        if self.tolerance is None:
            dtype = self.config.model.dtype
            self.tolerance = probe_tolerance_from(self.noise, [slot.name for slot, _, _, _ in checks], dtype)
            print(f"relay: sync probe tolerance {self.tolerance:.3g} ({PROBE_NOISE_FACTOR:g}x the engine-learner noise "
                  f"floor over {len(PROBE_NOISE_SEEDS)} probes, at least "
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
            moved = stale_probe(self.records.get(slot_id), record, self.noise)
            if moved is not None:
                earlier = self.records[slot_id].version
                raise SyncError(
                    f"weight sync check failed: {name} (version {version}) gives bit for bit the probe logprobs it "
                    f"gave at version {earlier}, while the learner's logprobs of the same tokens moved by {moved:.3g} "
                    f"(more than the noise floor {self.noise:.3g}) since: the engine did not apply the loads after "
                    f"version {earlier}")
            self.records[slot_id] = next_probe_record(self.records.get(slot_id), record)
        largest = max((gap for _, gap, _, _ in checks), default=0.0)
        self.gaps.append(largest)
        return largest

    def _tolerance_source(self) -> str:
        if self.config.sync.probe_tolerance is not None:
            return "sync.probe_tolerance"
        return "derived from the noise floor before the first update; set sync.probe_tolerance to override"

    def weights_digest(self) -> str:
        """What identifies the learner's current weights: the digest of its fingerprints, or without them the
        version."""
        if not self.config.sync.fingerprint:
            return f"version {self.version}"
        return digest(self.fingerprints_of(self.version))

    def fingerprints_of(self, version: int) -> dict[str, str]:
        """The learner's fingerprints of weights `version`: an exported version's (asked for by `export`), or the
        current version's (asked for now), read once."""
        export = self.exports.get(version)
        if export is not None and export.fingerprints is not None:
            export.fingerprints = self._read(export.fingerprints)
            return export.fingerprints
        if version != self.version:
            raise RuntimeError(f"the learner's fingerprints of weights version {version} were not asked for when it "
                               f"had them (it is at {self.version})")
        if self.expected is None or self.expected[0] != version:
            self.expected = (version, self.fleet.learner.weights_fingerprint.remote())
        self.expected = (version, self._read(self.expected[1]))
        return self.expected[1]

    def _read(self, value: Any) -> Any:
        """`value`, or what the learner returns for it when it is a ref (`timeouts.sync`)."""
        if isinstance(value, ray.ObjectRef):
            [value] = get([value], self.config.timeouts.sync, ["learner"], "sync")
        return value

    def probe_gaps(self, slots: list[RolloutSlot]) -> list[tuple[float, ProbeSample]]:
        """Per worker: (the root mean square engine-learner logprob gap of a seeded probe sample run now, the sample
        with the learner's logprobs filled in), without `verify`'s rules (bench/weight_sync.py's stale gap)."""
        return [(probe_gap(s.logprobs, s.learner_logprobs), s)
                for s in self.scored(self.score_probes(slots, self.engine_probes(slots)))]


def _sample_key(sample: ProbeSample) -> tuple:
    """What makes two probe samples the same for the learner to score: their tokens."""
    return tuple(sample.prompt_ids), tuple(sample.response_ids)
