"""How new weights travel from the learner to the rollout engines: one interface, a transport per `sync.transport`.

Owns: moving the learner's current weights into a given set of rollout workers and reporting, per worker, the weights
version it now serves with the fingerprints of what it received (`Loaded`), or why it failed (death or missed
deadline). `object_store` (the default) has the learner write its weights into its shared-memory buffer for workers
on its node (`sync.shared_memory`, learner/shared_weights.py), and export them once, in buckets of `sync.bucket_mb`,
as zero-copy numpy objects in Ray's object store for workers on other nodes; every worker loads them through the
engine's reload path. `collective` forms a torch.distributed group of
the learner (rank 0) and every engine worker, broadcasts the weights in flat buckets, and re-forms the group when the
fleet changes or a member fails (the group itself lives in learner/weight_group.py).
Does not own: which workers exist, replacing failed ones, or the probe check (cluster/rollout_pool.py); the version
and fingerprint checks of what a worker reports (RolloutPool does them, for every transport alike).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from cluster.remote import RunError, describe, get, get_ready

if TYPE_CHECKING:
    from actors.rollout_types import Loaded
    from cluster.rollout_pool import RolloutPool


class WeightTransport(Protocol):
    """What RolloutPool needs from a transport."""

    def load(self, indices: list[int]) -> tuple[dict[int, Loaded], dict[int, str]]:
        """Load the learner's current weights (version `pool.weights_version`) into the workers at `indices`:
        ({index: what it reports, a `Loaded`}, {index: why it failed}). Raises RunError when the learner itself
        fails."""
        ...

    def defer(self) -> dict[int, list] | None:
        """The arguments that let each worker load the learner's current weights itself at the start of its next
        `generate` call, by slot id (RolloutWorker.generate's `version, *buckets`), or None when this transport cannot
        do that (both ends of a collective must take part at once)."""
        ...

    def check_learner(self) -> None:
        """After requests that carried deferred loads failed: raise a RunError if the learner's side failed (only
        called for transports whose `defer` gives loads)."""
        ...

    def fleet_changed(self) -> None:
        """Workers were added, removed or replaced: forget per-worker state (a collective group is re-formed on the
        next `load`)."""
        ...

    def close(self) -> None:
        ...


class ObjectStoreTransport:
    """Workers on the learner's node read its shared-memory buffer, which it rewrites in place (`sync.shared_memory`);
    for the others the learner puts its weights once per load as one object-store object per bucket."""

    def __init__(self, pool: RolloutPool):
        self.pool = pool
        config = pool.config
        learner = pool.fleet.learner
        self.bucket_bytes = int(config.sync.bucket_mb * 2**20)
        self.timeout = config.timeouts.sync
        self.num_buckets, self.learner_node = get(
            [learner.count_buckets.remote(self.bucket_bytes), learner.__ray_call__.remote(_node_id)], self.timeout,
            ["learner"] * 2, "sync")
        self.exported: list = []  # refs of the latest export: the buffer's handle and/or the buckets

    def load(self, indices: list[int]) -> tuple[dict[int, Loaded], dict[int, str]]:
        pool = self.pool
        loads = self.export(indices)
        refs = {i: pool.workers[i].load_weights.remote(pool.weights_version, *loads[i]) for i in indices}
        done, failed = collect(refs, self.timeout, "sync")
        if failed:
            self.check_learner()
        return done, failed

    def defer(self) -> dict[int, list]:
        loads = self.export(list(range(len(self.pool.workers))))
        return {self.pool.fleet.rollout[i].id: [self.pool.weights_version, *load] for i, load in loads.items()}

    def export(self, indices: list[int]) -> dict[int, list]:
        """What each worker (by index) loads the learner's current weights from, as refs Ray resolves before the
        worker's call runs: the handle of the learner's shared-memory buffer on its node, one object per bucket on
        others. The learner runs calls in order, so either holds the weights as of now, whatever it does next."""
        pool, learner = self.pool, self.pool.fleet.learner
        local = [i for i in indices if pool.config.sync.shared_memory
                 and pool.fleet.rollout[i].node_id == self.learner_node]
        loads: dict[int, list] = {}
        self.exported = []
        if local:
            self.exported.append(learner.share_weights.remote(pool.weights_version))
            loads.update((i, self.exported[:1]) for i in local)
        if len(local) < len(indices):
            export = learner.export_weight_buckets.options(num_returns=self.num_buckets)
            buckets = export.remote(self.bucket_bytes)
            buckets = list(buckets) if self.num_buckets > 1 else [buckets]
            self.exported += buckets
            loads.update((i, buckets) for i in indices if i not in local)
        return loads

    def check_learner(self) -> None:
        """After loads failed: the workers' fault, or the learner's? Raises a RunError naming the learner when it
        died (before or after its export) or its latest export failed."""
        refs = [self.pool.fleet.learner.__ray_ready__.remote(), *self.exported]
        get(refs, self.timeout, ["learner"] * len(refs), "sync")

    def fleet_changed(self) -> None:
        pass

    def close(self) -> None:
        pass


def _node_id(_) -> str:
    return ray.get_runtime_context().get_node_id()


class CollectiveTransport:
    """A weight-broadcast group of the learner (rank 0) and every vLLM worker of the workers being loaded.

    The group is kept while the same workers are loaded again; it is re-formed (on a new port) when the fleet changed,
    when a different set of workers is loaded (a replacement alone, while the others generate), and after any failure.
    One load makes up to two attempts: members that die or miss the deadline fail; members whose broadcast failed
    because of them (their collective errored or was aborted) are loaded again in a group of the survivors. Every
    collective has the `timeouts.sync` timeout; the learner's death stops the run."""

    GRACE_S = 5.0  # beyond the collectives' own timeout, for their errors to come back through Ray

    def __init__(self, pool: RolloutPool):
        self.pool = pool
        config = pool.config
        self.bucket_bytes = int(config.sync.bucket_mb * 2**20)
        self.timeout = config.timeouts.sync
        self.members: list[Any] = []  # worker actors of the current group, in rank order
        self.stale = True
        self.ranks: dict[str, int] = {}  # actor id -> vLLM workers of its engine (group members it adds)
        self.leaving: list[Any] = []  # `leave_weight_group` calls to workers no longer in the group
        self.last_broadcast: dict[str, float] = {}  # the learner's last {"seconds", "bytes"}
        learner = pool.fleet.learner
        self.host = get([learner.__ray_call__.remote(lambda _: ray.util.get_node_ip_address())], self.timeout,
                        ["learner"], "sync")[0]

    def load(self, indices: list[int]) -> tuple[dict[int, Loaded], dict[int, str]]:
        done: dict[int, Loaded] = {}
        failed: dict[int, str] = {}
        todo = list(indices)
        for _ in range(2):
            loaded, lost, retry = self._attempt(todo)
            done.update(loaded)
            failed.update(lost)
            if not retry:
                break
            todo = sorted(retry)
        else:
            failed.update(retry)  # failed in a group of survivors too: its own fault
        return done, failed

    def defer(self) -> None:
        return None

    def fleet_changed(self) -> None:
        self.stale = True

    def close(self) -> None:
        """Leave the group on the learner and every member (best effort: this is the end of the run)."""
        alive = set(map(_id, self.pool.workers))
        refs = [self.pool.fleet.learner.leave_weight_group.remote()]
        refs += [m.leave_weight_group.remote() for m in self.members if _id(m) in alive] + self.leaving
        self.members, self.leaving, self.stale = [], [], True
        _drain(refs, timeout=10)

    def _attempt(self, indices: list[int]) -> tuple[dict[int, Loaded], dict[int, str], dict[int, str]]:
        """Form the group if needed, then broadcast: ({index: Loaded}, {index: failure}, {index: to load again})."""
        workers = [self.pool.workers[i] for i in indices]
        if self.stale or [_id(w) for w in workers] != [_id(m) for m in self.members]:
            lost, retry = self._form(indices)
            if lost or retry:
                return {}, lost, retry
        deadline = self.timeout + self.GRACE_S
        learner_ref = self.pool.fleet.learner.broadcast_weights.remote()
        refs = {i: self.pool.workers[i].receive_weights.remote(self.pool.weights_version) for i in indices}
        learner_result, done, lost, retry = _settle(learner_ref, refs, deadline, "sync")
        if isinstance(learner_result, dict):
            self.last_broadcast = learner_result
        if lost or retry or not isinstance(learner_result, dict):
            self.stale = True  # every member has aborted its end of the group
        return done, lost, retry

    def _form(self, indices: list[int]) -> tuple[dict[int, str], dict[int, str]]:
        """A new group of the learner and `indices`' workers: ({index: died or missed the deadline}, {index: to try
        again}); both empty when the group formed."""
        pool, learner = self.pool, self.pool.fleet.learner
        workers = {i: pool.workers[i] for i in indices}
        self._leave_old(set(map(_id, workers.values())))
        lost = self._ask_ranks(workers)
        if lost:
            return lost, {}
        first_ranks, world_size = {}, 1
        for i, worker in workers.items():
            first_ranks[i] = world_size
            world_size += self.ranks[_id(worker)]
        spec = get([learner.open_weight_group.remote(self.host, world_size, self.bucket_bytes, self.timeout)],
                   self.timeout, ["learner"], "sync")[0]
        learner_ref = learner.join_weight_group.remote()
        refs = {i: w.join_weight_group.remote(spec, first_ranks[i]) for i, w in workers.items()}
        learner_result, _, lost, retry = _settle(learner_ref, refs, self.timeout + self.GRACE_S, "sync")
        if lost or retry or isinstance(learner_result, Exception):
            # Forming is all or nothing: every member that did not fail tries again in a group without those that did.
            why = describe(learner_result) if isinstance(learner_result, Exception) else "another member failed"
            return lost, {i: retry.get(i, f"could not form its weight group ({why})") for i in indices if i not in lost}
        self.members, self.stale = list(workers.values()), False
        return {}, {}

    def _ask_ranks(self, workers: dict[int, Any]) -> dict[int, str]:
        """Learn how many group members each new worker adds; returns the workers that failed to answer."""
        new = {i: w for i, w in workers.items() if _id(w) not in self.ranks}
        if not new:
            return {}
        done, failed = collect({i: w.weight_group_ranks.remote() for i, w in new.items()}, self.timeout, "sync")
        self.ranks.update({_id(new[i]): ranks for i, ranks in done.items()})
        return failed

    def _leave_old(self, keep: set[str]) -> None:
        """The current group's members that are not in the next one leave it. Not waited for: such a worker may be
        generating (a replacement is loaded alone meanwhile); the call runs once it is free."""
        alive = set(map(_id, self.pool.workers))
        self.leaving += [m.leave_weight_group.remote() for m in self.members if _id(m) in alive - keep]
        self.members, self.stale = [], True
        ready, self.leaving = ray.wait(self.leaving, num_returns=len(self.leaving), timeout=0)
        _drain(ready, timeout=0)


def _id(actor: Any) -> str:
    return actor._actor_id.hex()


def _settle(learner_ref: Any, refs: dict[int, Any], timeout: float,
            what: str) -> tuple[Any, dict[int, Any], dict[int, str], dict[int, str]]:
    """Wait for the learner's side and the workers' sides of one collective step, up to the deadline:
    (the learner's result or its error, {index: result}, {index: died or missed the deadline}, {index: raised}).
    The learner's death, or its missing the deadline (the collectives time out before it), stops the run."""
    everything = [learner_ref, *refs.values()]
    ready, _ = ray.wait(everything, num_returns=len(everything), timeout=timeout)
    if learner_ref not in ready:
        raise RunError(f"learner missed the {timeout:g} s deadline of '{what}' (raise timeouts.{what} if the weight "
                       "broadcast is legitimately slow)")
    try:
        learner_result: Any = ray.get(learner_ref)
    except RayTaskError as err:  # its collective failed: because of a member, judged below
        learner_result = err
    except RayError as err:
        raise RunError(f"an actor died during '{what}': {err.__class__.__name__}: "
                       f"{str(err).splitlines()[0]}") from err
    done: dict[int, Any] = {}
    lost: dict[int, str] = {}
    retry: dict[int, str] = {}
    for i, ref in refs.items():
        if ref not in ready:
            lost[i] = f"missed the {timeout:g} s deadline of '{what}'"
            continue
        try:
            done[i] = ray.get(ref)
        except RayTaskError as err:
            retry[i] = f"failed during '{what}' ({describe(err)})"
        except RayActorError as err:
            lost[i] = f"died during '{what}' ({describe(err)})"
        except RayError as err:
            lost[i] = f"failed during '{what}' ({describe(err)})"
    return learner_result, done, lost, retry


def _drain(refs: list[Any], timeout: float) -> None:
    """Wait up to `timeout` for best-effort calls and consume their results: a worker that died meanwhile cannot
    leave its group, and its group went with it."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except RayError:
            pass


def collect(refs: dict[int, Any], timeout: float, what: str) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every call up to the deadline: ({index: result}, {index: why it failed})."""
    ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)[0])
    finished = [i for i, ref in refs.items() if ref in ready]
    done: dict[int, Any] = {}
    failed = {i: f"missed the {timeout:g} s deadline of '{what}'" for i in refs if i not in finished}
    for i, (value, error) in zip(finished, get_ready([refs[i] for i in finished])):
        if error is None:
            done[i] = value
        else:
            failed[i] = f"failed during '{what}' ({error})"
    return done, failed


TRANSPORTS: dict[str, type] = {"object_store": ObjectStoreTransport, "collective": CollectiveTransport}


def make_transport(pool: RolloutPool) -> WeightTransport:
    return TRANSPORTS[pool.config.sync.transport](pool)
