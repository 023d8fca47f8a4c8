"""How new weights travel from the learner to the rollout engines: one interface, a transport per `sync.transport`.

Owns: moving the learner's current weights into a given set of rollout workers and reporting, per worker, the
weights version it now serves or why it failed (death or missed deadline). `object_store` (the default) has the
learner export its weights once, in buckets of `sync.bucket_mb`, as zero-copy numpy objects that every worker reads
and loads through the engine's reload path.
Does not own: which workers exist, replacing failed ones, or the probe check (cluster/rollout_pool.py); the version
check of what a worker reports (RolloutPool does it, for every transport alike).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray.exceptions import RayError

from cluster.remote import get

if TYPE_CHECKING:
    from cluster.rollout_pool import RolloutPool


class WeightTransport(Protocol):
    """What RolloutPool needs from a transport."""

    def load(self, indices: list[int]) -> tuple[dict[int, int], dict[int, str]]:
        """Load the learner's current weights (version `pool.weights_version`) into the workers at `indices`:
        ({index: version it reports}, {index: why it failed}). Raises RunError when the learner itself fails."""
        ...

    def fleet_changed(self) -> None:
        """Workers were added, removed or replaced: forget per-worker state (a collective group is re-formed on the
        next `load`)."""
        ...

    def close(self) -> None:
        ...


class ObjectStoreTransport:
    """The learner puts its weights once per load as one object-store object per bucket; every worker reads them."""

    def __init__(self, pool: RolloutPool):
        self.pool = pool
        config = pool.config
        self.bucket_bytes = int(config.sync.bucket_mb * 2**20)
        self.num_buckets = get([pool.fleet.learner.count_buckets.remote(self.bucket_bytes)], config.timeouts.sync,
                               ["learner"], "sync")[0]

    def load(self, indices: list[int]) -> tuple[dict[int, int], dict[int, str]]:
        pool = self.pool
        export = pool.fleet.learner.export_weight_buckets.options(num_returns=self.num_buckets)
        buckets = export.remote(self.bucket_bytes)
        buckets = buckets if self.num_buckets > 1 else [buckets]
        refs = {i: pool.workers[i].load_weights.remote(pool.weights_version, *buckets) for i in indices}
        done, failed = collect(refs, pool.config.timeouts.sync, "sync")
        if failed:  # the workers' fault, or the learner's? A dead learner fails every load through its buckets.
            get(list(buckets), pool.config.timeouts.sync, ["learner"] * len(buckets), "sync")
        return done, failed

    def fleet_changed(self) -> None:
        pass

    def close(self) -> None:
        pass


def collect(refs: dict[int, Any], timeout: float, what: str) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every call up to the deadline: ({index: result}, {index: why it failed})."""
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    ready = set(ready)
    done: dict[int, Any] = {}
    failed: dict[int, str] = {}
    for i, ref in refs.items():
        if ref not in ready:
            failed[i] = f"missed the {timeout:g} s deadline of '{what}'"
            continue
        try:
            done[i] = ray.get(ref)
        except RayError as err:
            failed[i] = f"died during '{what}' ({err.__class__.__name__}: {str(err).splitlines()[0][:200]})"
    return done, failed


TRANSPORTS: dict[str, type] = {"object_store": ObjectStoreTransport}


def make_transport(pool: RolloutPool) -> WeightTransport:
    return TRANSPORTS[pool.config.sync.transport](pool)
