"""Verifying a sync: the rules that decide whether an engine serves the learner's weights.

Owns: `check_loaded` (a worker's report of a load against the learner's version and fingerprints, compared by
`differences`: what the worker's fingerprints lack or get wrong, in one line), `digest` (one string for a version's
fingerprints), the probe's gap (`probe_gap`: the root mean square of |engine - learner| logprob over its tokens), its
noise floor over several seeded draws on the same weights (`probe_noise`, `PROBE_NOISE_SEEDS`) and the tolerance
derived from it (`probe_tolerance_from`), and the probe's repeat rule (`stale_probe`, `next_probe_record`: an engine
that repeats an earlier version's seeded probe bit for bit while the learner's logprobs of it moved beyond the noise
did not apply the load), with `SyncError`, which stops the run.
Does not own: calling the workers and the learner for the probe (cluster/fleet/weight_sync.py) or the load
(sync/transport.py). Functions over plain data.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from sync.calls import RunError

if TYPE_CHECKING:
    from sync.receive import Loaded

PROBE_SEED = 0  # one seed for every probe: an engine still on the weights of its last probe repeats it bit for bit
# The first probe's draws, engines and learner on the same weights: the noise floor is their largest gap. One draw of a
# few tokens is not enough in bfloat16, where a draw's gap depends on whether it sampled an unlikely token
# (docs/benchmarks.md, the sync probe's noise floor). PROBE_SEED's draw is the one later probes repeat.
PROBE_NOISE_SEEDS = tuple(range(PROBE_SEED, PROBE_SEED + 8))


class SyncError(RunError):
    """An engine does not serve the learner's weights after a sync."""


def digest(fingerprints: dict[str, str]) -> str:
    """One string for a whole set of fingerprints (a weights version), independent of the names' order."""
    return hashlib.blake2b(repr(sorted(fingerprints.items())).encode(), digest_size=8).hexdigest()


def differences(expected: dict[str, str], received: dict[str, str]) -> str | None:
    """What `received` (a worker's) lacks or gets wrong against `expected` (the learner's), in one line; None when
    they are the same."""
    missing = [name for name in expected if name not in received]
    wrong = [name for name in expected if name in received and received[name] != expected[name]]
    extra = [name for name in received if name not in expected]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the {len(expected)} tensors never reached the engine (first: {missing[0]})")
    if wrong:
        problems.append(f"{len(wrong)} arrived with other contents than the learner's (first: {wrong[0]})")
    if extra:
        problems.append(f"{len(extra)} that the learner did not send (first: {extra[0]})")
    return "; ".join(problems) or None


def check_loaded(name: str, loaded: Loaded | None, version: int, expected: dict[str, str] | None) -> None:
    """Raise SyncError unless worker `name` reports a load of `version` and, given the learner's fingerprints
    `expected` (`sync.fingerprint`), handed its engine exactly those tensors in every engine process."""
    if loaded is None:
        raise SyncError(f"weight sync check failed: {name} was sent weights version {version} with its request but "
                        "reports no load")
    if loaded.version != version:
        raise SyncError(f"{name} serves weights version {loaded.version}, expected {version}")
    if expected is None:
        return
    if not loaded.fingerprints:
        raise SyncError(f"weight sync check failed: {name} (version {loaded.version}) reports no fingerprints of "
                        "the weights it loaded (sync.fingerprint is on)")
    for rank, received in enumerate(loaded.fingerprints):
        problem = differences(expected, received)
        if problem is not None:
            where = f" (engine process {rank})" if len(loaded.fingerprints) > 1 else ""
            raise SyncError(f"weight sync check failed: {name}{where} (version {loaded.version}) did not get the "
                            f"learner's weights: {problem}")


# Far above float32's engine-learner noise, far below what one float32 step at lr 1e-6 moves the probe
# (docs/benchmarks.md, the sync probe's limits).
PROBE_TOLERANCE_MIN = 1e-4
# bfloat16's minimum: one bfloat16 ulp of a logit of magnitude 16 to 32, a trained LM's top logits. The noise floor is
# measured before any update; training that sharpens the logits raises bfloat16's noise past a multiple of it, which
# this minimum absorbs (docs/benchmarks.md, the sync probe's noise floor).
PROBE_TOLERANCE_MIN_BFLOAT16 = 2.0**-3
PROBE_NOISE_FACTOR = 3.0  # the tolerance over the noise floor (the largest gap of `PROBE_NOISE_SEEDS`' draws)
PROBE_NOISE_CEILING = 0.25  # a gap on the same weights above this is a wrong model or engine, not numerics


def probe_gap(engine: Sequence[float], learner: Sequence[float]) -> float:
    """The probe's gap: the root mean square over its T tokens of the engine's logprob e_t minus the learner's l_t,
    sqrt(1/T sum_t (e_t - l_t)^2); 0 for no tokens. Not the largest token's: in bfloat16 an unlikely token's gap is
    several times a likely one's, so the largest depends on whether the draw sampled one; a stale engine moves most
    tokens, the root mean square with them. NaN if either side has a NaN (the check then fails)."""
    if len(engine) != len(learner):
        raise ValueError(f"the engine scored {len(engine)} probe tokens, the learner {len(learner)}")
    if not engine:
        return 0.0
    return math.sqrt(math.fsum((e - le) ** 2 for e, le in zip(engine, learner)) / len(engine))


def probe_noise(draws: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float:
    """The noise floor: the largest `probe_gap` over draws of (engine logprobs, learner logprobs) of the same tokens,
    engines and learner on the same weights (`PROBE_NOISE_SEEDS`' draws before any update); 0 without draws."""
    return max((probe_gap(engine, learner) for engine, learner in draws), default=0.0)


def probe_tolerance_from(noise: float, names: list[str], dtype: str = "float32") -> float:
    """The probe's tolerance from the noise floor `noise` (`probe_noise`): `PROBE_NOISE_FACTOR` x it, at least
    `probe_tolerance_min(dtype)`; a floor above `PROBE_NOISE_CEILING` raises SyncError naming the workers `names`."""
    if not noise <= PROBE_NOISE_CEILING:
        raise SyncError(f"weight sync check failed before the first update: the engines' probe logprobs differ from "
                        f"the learner's by {noise:.3g} (> {PROBE_NOISE_CEILING}) on the weights both started from "
                        f"({', '.join(names)}); that is not numerics: check model.path and the engine's dtype")
    return max(probe_tolerance_min(dtype), PROBE_NOISE_FACTOR * noise)


def probe_tolerance_min(dtype: str) -> float:
    """The smallest tolerance `probe_tolerance_from` derives for engines in `dtype` (`model.dtype`)."""
    return PROBE_TOLERANCE_MIN_BFLOAT16 if dtype == "bfloat16" else PROBE_TOLERANCE_MIN


class ProbeRecord(NamedTuple):
    """One worker's probe at one version, with what identifies the learner's weights then (the digest of their
    fingerprints, or the version)."""

    version: int
    weights: str
    response_ids: tuple[int, ...]
    engine: tuple[float, ...]  # the engine's logprobs of the response tokens
    learner: tuple[float, ...]  # the learner's


def stale_probe(earlier: ProbeRecord | None, now: ProbeRecord, noise: float) -> float | None:
    """How far the learner's logprobs of the probe moved from `earlier` to `now` (the largest token's move), if the
    engine's stayed bit for bit the same meanwhile though the learner's weights changed and moved them by more than
    the noise floor `noise` (`probe_noise`; at least `PROBE_TOLERANCE_MIN / PROBE_NOISE_FACTOR`); else None.

    An engine serving the same weights repeats a seeded probe exactly (same tokens, same batch); one serving new
    weights does not, unless their change is too small to reach the probe's logits, and then the learner's logprobs
    do not move beyond the noise either. So the engine is closer to the earlier weights than to the new ones, whatever
    the dtype: this sees one stale step in bfloat16, where the gap to the learner cannot (docs/benchmarks.md)."""
    if not _repeated(earlier, now) or earlier.weights == now.weights:
        return None
    moved = max((abs(a - b) for a, b in zip(earlier.learner, now.learner)), default=0.0)
    return moved if moved > max(noise, PROBE_TOLERANCE_MIN / PROBE_NOISE_FACTOR) else None


def next_probe_record(earlier: ProbeRecord | None, now: ProbeRecord) -> ProbeRecord:
    """The record to compare the next probe with: `now`, unless the engine's probe did not change since `earlier`
    (then `earlier` stays, so a learner that keeps moving away from an engine that does not follow is seen once its
    moves add up beyond the noise)."""
    return earlier if _repeated(earlier, now) else now


def _repeated(earlier: ProbeRecord | None, now: ProbeRecord) -> bool:
    """The engine gave `now`'s probe bit for bit as at `earlier`: the same tokens with the same logprobs."""
    return earlier is not None and earlier.response_ids == now.response_ids and earlier.engine == now.engine
