"""Iterative GRPO's reference refresh (`reference.refresh_every`): the reference actor takes the policy's current
weights, verified as the engines' are.

Owns: when a refresh is due, handing the learner's weights to the reference (object-store buckets exported by the
learner's rank 0, whatever `sync.transport` the engines use), checking what it got against the learner's
fingerprints of that version (`sync.fingerprint`) and its logprobs of the engines' latest probe sample against the
learner's (`sync.probe`, the engines' tolerance), the version the reference holds, and saving / restoring the
reference's weights with a checkpoint (a refreshed reference cannot be rebuilt from anything else a checkpoint
holds).
Does not own: the KL (learner/), the reference actor (actors/reference.py), the rules of the checks
(sync/verify.py) or the learner's fingerprints (cluster/fleet/weight_sync.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.config import RunConfig
from sync.calls import get
from sync.verify import PROBE_TOLERANCE_MIN, SyncError, check_loaded, probe_gap

REFERENCE_DIR = "reference"  # in a checkpoint: the refreshed reference's weights


class ReferenceRefresh:
    """`version`: the policy version the reference holds (0: the initial weights); `last_gap`: the last probe's."""

    def __init__(self, config: RunConfig, fleet: Any, pool: Any):
        self.config = config
        self.fleet = fleet
        self.pool = pool  # the RolloutPool: the learner's fingerprints, the probe prompt and tolerance
        self.every = config.reference.refresh_every
        self.version = 0
        self.num_buckets: int | None = None
        self.last_gap = float("nan")

    def due(self, step: int) -> bool:
        """Whether step `step`'s reference pass follows a refresh (a multiple of `refresh_every`, after step 1: at
        step 1 the policy is still the reference)."""
        return bool(self.every) and step > 1 and step % self.every == 0 and self.fleet.reference is not None

    def refresh(self, version: int) -> None:
        """Hand the learner's current weights (version `version`) to the reference and check them; returns when the
        reference holds them (the learner exports them after any update it is running)."""
        cfg, group = self.config, self.fleet.learner_group
        bucket_bytes = int(cfg.sync.bucket_mb * 2**20)
        if self.num_buckets is None:
            self.num_buckets = group.count_buckets(bucket_bytes)
        buckets = group.export_weight_buckets(bucket_bytes, self.num_buckets)
        # The export waits for an update the learner is running (asynchronous training): its deadline counts too.
        [loaded] = get([self.fleet.reference.load_weights.remote(version, *buckets,
                                                                 fingerprint=cfg.sync.fingerprint)],
                       cfg.timeouts.train + cfg.timeouts.sync, ["reference"], "sync")
        expected = self.pool.fingerprints_of(version) if cfg.sync.fingerprint else None
        check_loaded("reference", loaded, version, expected)
        self.version = version
        self.last_gap = self.probe() if cfg.sync.probe else float("nan")

    def probe(self) -> float:
        """The reference's and the learner's logprobs of the latest probe sample the engines were checked with must
        agree within the engines' probe tolerance (a sample, not arbitrary text: in bfloat16 the logprobs of unlikely
        tokens differ by far more between two correct implementations); returns the largest gap."""
        if self.pool.probe_sample is None:
            return float("nan")  # no worker ran the probe yet: nothing to score
        prompt, response = self.pool.probe_sample
        [theirs] = get([self.fleet.reference.compute_logprobs.remote([prompt], [response])],
                       self.config.timeouts.sync, ["reference"], "sync")[0]
        [ours] = self.fleet.learner_group.compute_logprobs([prompt], [response])
        gap = probe_gap(theirs, ours)
        tolerance = self.pool.tolerance or PROBE_TOLERANCE_MIN
        if not gap <= tolerance:
            raise SyncError(f"reference refresh check failed: the reference (version {self.version}) gives probe "
                            f"logprobs that differ from the learner's by {gap:.3g} > the probe tolerance "
                            f"{tolerance:.3g}; it is not serving the learner's weights")
        return gap

    def save(self, checkpoint_dir: Path) -> dict[str, int]:
        """Write the refreshed reference's weights into a checkpoint being written; its driver-state entry."""
        if self.version:
            get([self.fleet.reference.save_weights.remote(str(checkpoint_dir / REFERENCE_DIR))],
                self.config.timeouts.sync, ["reference"], "checkpoint")
        return {"reference_version": self.version}

    def restore(self, checkpoint_dir: Path, state: dict[str, Any]) -> None:
        """Give the reference the weights a checkpoint holds for it (none: it is still the initial policy)."""
        self.version = int(state.get("reference_version", 0))
        if self.version and self.fleet.reference is not None:
            get([self.fleet.reference.load_saved.remote(str(checkpoint_dir / REFERENCE_DIR))],
                self.config.timeouts.sync, ["reference"], "checkpoint")
