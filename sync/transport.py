"""How new weights travel from the learner to the rollout engines: one interface, a transport per `sync.transport`.

Owns: moving the learner's current weights into a given set of rollout workers and reporting, per worker, the weights
version it now serves with the fingerprints of what it received (`Loaded`), or why it failed (death or missed
deadline). `object_store` (the default): shared memory for workers on the learner's node, buckets of `sync.bucket_mb`
in Ray's object store for the others (`ObjectStoreTransport`). `collective`: a torch.distributed group of the learner
and every engine worker, broadcasting flat buckets (`CollectiveTransport`; the group is sync/group.py's). A transport
gets the publisher (sync/publisher.py), the workers to load (an `actor` and its `node_id`), the version, the sync
config and the deadline.
Does not own: which workers exist or replacing failed ones (cluster/fleet/rollout_pool.py), the probe
(cluster/fleet/weight_sync.py); the version and fingerprint checks of what a worker reports (sync/verify.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import ray

from sync.calls import Outcome, get, values, wait_all
from sync.config import SyncConfig

if TYPE_CHECKING:
    from sync.receive import Loaded


class Worker(Protocol):
    """A rollout worker as a transport sees it."""

    actor: Any
    node_id: str  # the Ray node its engine runs on


class WeightTransport(Protocol):
    """What RolloutPool needs from a transport."""

    def load(self, workers: Mapping[int, Worker], version: int) -> tuple[dict[int, Loaded], dict[int, str]]:
        """Load the learner's current weights, as `version`, into `workers` (by key): ({key: what it reports, a
        `Loaded`}, {key: why it failed}). Raises RunError when the learner itself fails."""
        ...

    def defer(self, workers: Mapping[int, Worker], version: int) -> dict[int, list] | None:
        """The arguments that let each worker load the learner's current weights itself at the start of its next
        `generate` call, by key (RolloutWorker.generate's `version, *buckets`), or None when this transport cannot
        do that (both ends of a collective must take part at once)."""
        ...

    def fleet_changed(self, actors: Sequence[Any]) -> None:
        """Workers were added, removed or replaced (`actors`: the fleet's now): forget per-worker state (a collective
        group is re-formed on the next `load`)."""
        ...

    def close(self) -> None:
        ...


class ObjectStoreTransport:
    """Workers on the learner's node read its shared-memory buffer, which it rewrites in place (`sync.shared_memory`);
    for the others the learner puts its weights once per load as one object-store object per bucket."""

    def __init__(self, config: SyncConfig, publisher: Any, timeout: float):
        self.config = config
        self.publisher = publisher
        self.bucket_bytes = int(config.bucket_mb * 2**20)
        self.timeout = timeout
        self.num_buckets, self.learner_node = get(
            [publisher.count_buckets.remote(self.bucket_bytes), publisher.__ray_call__.remote(_node_id)], timeout,
            ["learner"] * 2, "sync")
        self.exported: list = []  # refs of the latest export: the buffer's handle and/or the buckets

    def load(self, workers: Mapping[int, Worker], version: int) -> tuple[dict[int, Loaded], dict[int, str]]:
        loads = self.defer(workers, version)
        refs = {key: workers[key].actor.load_weights.remote(*load) for key, load in loads.items()}
        done, failed = collect(refs, self.timeout, "sync")
        if failed:
            self.check_learner()
        return done, failed

    def defer(self, workers: Mapping[int, Worker], version: int) -> dict[int, list]:
        """What each worker (by key) loads the learner's current weights from, after the version: refs Ray resolves
        before the worker's call runs, the handle of the learner's shared-memory buffer on its node, one object per
        bucket on others. The learner runs calls in order, so either holds the weights as of now, whatever it does
        next."""
        local = [key for key, w in workers.items() if self.config.shared_memory and w.node_id == self.learner_node]
        loads: dict[int, list] = {}
        self.exported = []
        if local:
            self.exported.append(self.publisher.share_weights.remote(version))
            loads.update((key, [version, *self.exported[:1]]) for key in local)
        if len(local) < len(workers):
            shared, load = self.exported, self.export(version)
            self.exported = shared + self.exported
            loads.update((key, load) for key in workers if key not in local)
        return loads

    def export(self, version: int) -> list:
        """The learner's current weights as one object-store object per bucket: `[version, *bucket refs]`, what any
        worker on any node loads them from for as long as the caller holds the refs (asynchronous training keeps
        every version still in flight; the shared-memory buffer holds only the latest)."""
        export = self.publisher.export_weight_buckets.options(num_returns=self.num_buckets)
        buckets = export.remote(self.bucket_bytes)
        self.exported = list(buckets) if self.num_buckets > 1 else [buckets]
        return [version, *self.exported]

    def check_learner(self) -> None:
        """After loads failed: the workers' fault, or the learner's? Raises a RunError naming the learner when it
        died (before or after its export) or its latest export failed."""
        refs = [self.publisher.__ray_ready__.remote(), *self.exported]
        get(refs, self.timeout, ["learner"] * len(refs), "sync")

    def fleet_changed(self, actors: Sequence[Any]) -> None:
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

    def __init__(self, config: SyncConfig, publisher: Any, timeout: float):
        self.publisher = publisher
        self.bucket_bytes = int(config.bucket_mb * 2**20)
        self.timeout = timeout
        self.members: list[Any] = []  # worker actors of the current group, in rank order
        self.stale = True
        self.ranks: dict[str, int] = {}  # actor id -> vLLM workers of its engine (group members it adds)
        self.leaving: list[Any] = []  # `leave_weight_group` calls to workers no longer in the group
        self.alive: set[str] = set()  # actor ids of the fleet's workers (`fleet_changed`)
        self.last_broadcast: dict[str, float] = {}  # the learner's last {"seconds", "bytes"}
        self.host = get([publisher.__ray_call__.remote(lambda _: ray.util.get_node_ip_address())], self.timeout,
                        ["learner"], "sync")[0]

    def load(self, workers: Mapping[int, Worker], version: int) -> tuple[dict[int, Loaded], dict[int, str]]:
        done: dict[int, Loaded] = {}
        failed: dict[int, str] = {}
        todo = {key: w.actor for key, w in workers.items()}
        self.alive |= set(map(_id, todo.values()))
        for _ in range(2):
            loaded, lost, retry = self._attempt(todo, version)
            done.update(loaded)
            failed.update(lost)
            if not retry:
                break
            todo = {key: todo[key] for key in sorted(retry)}
        else:
            failed.update(retry)  # failed in a group of survivors too: its own fault
        return done, failed

    def defer(self, workers: Mapping[int, Worker], version: int) -> None:
        return None

    def fleet_changed(self, actors: Sequence[Any]) -> None:
        self.alive = set(map(_id, actors))
        self.stale = True

    def close(self) -> None:
        """Leave the group on the learner and every member (best effort: this is the end of the run)."""
        refs = [self.publisher.leave_weight_group.remote()]
        refs += [m.leave_weight_group.remote() for m in self.members if _id(m) in self.alive] + self.leaving
        self.members, self.leaving, self.stale = [], [], True
        _drain(refs, timeout=10)

    def _attempt(self, workers: dict[int, Any], version: int
                 ) -> tuple[dict[int, Loaded], dict[int, str], dict[int, str]]:
        """Form the group if needed, then broadcast: ({key: Loaded}, {key: failure}, {key: to load again})."""
        if self.stale or list(map(_id, workers.values())) != list(map(_id, self.members)):
            lost, retry = self._form(workers)
            if lost or retry:
                return {}, lost, retry
        learner_ref = self.publisher.broadcast_weights.remote()
        refs = {key: actor.receive_weights.remote(version) for key, actor in workers.items()}
        learner, done, lost, retry = _settle(learner_ref, refs, self.timeout + self.GRACE_S, "sync")
        if learner.ok:
            self.last_broadcast = learner.value
        if lost or retry or not learner.ok:
            self.stale = True  # every member has aborted its end of the group
        return done, lost, retry

    def _form(self, workers: dict[int, Any]) -> tuple[dict[int, str], dict[int, str]]:
        """A new group of the learner and `workers`: ({key: died or missed the deadline}, {key: to try again}); both
        empty when the group formed."""
        learner = self.publisher
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
        joined, _, lost, retry = _settle(learner_ref, refs, self.timeout + self.GRACE_S, "sync")
        if lost or retry or not joined.ok:
            # Forming is all or nothing: every member that did not fail tries again in a group without those that did.
            why = joined.cause if not joined.ok else "another member failed"
            return lost, {k: retry.get(k, f"could not form its weight group ({why})") for k in workers if k not in lost}
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
        self.leaving += [m.leave_weight_group.remote() for m in self.members if _id(m) in self.alive - keep]
        self.members, self.stale = [], True
        ready, self.leaving = ray.wait(self.leaving, num_returns=len(self.leaving), timeout=0)
        _drain(ready, timeout=0)


def _id(actor: Any) -> str:
    return actor._actor_id.hex()


def _settle(learner_ref: Any, refs: dict[int, Any], timeout: float,
            what: str) -> tuple[Outcome, dict[int, Any], dict[int, str], dict[int, str]]:
    """Wait for the learner's side and the workers' sides of one collective step, up to the deadline:
    (the learner's outcome, {key: result}, {key: died or missed the deadline}, {key: raised}).
    The learner's death, or its missing the deadline (the collectives time out before it), stops the run."""
    learner, *outcomes = wait_all([learner_ref, *refs.values()], timeout, what)
    if learner.kind in ("late", "died"):
        values([learner], ["learner"], what)  # raises the RunError
    done = {key: o.value for key, o in zip(refs, outcomes) if o.ok}
    lost = {key: o.error for key, o in zip(refs, outcomes) if o.kind in ("died", "late")}
    retry = {key: o.error for key, o in zip(refs, outcomes) if o.kind == "raised"}  # its collective failed
    return learner, done, lost, retry


def _drain(refs: list[Any], timeout: float) -> None:
    """Wait up to `timeout` for best-effort calls and consume their results, failures included: a worker that died
    meanwhile cannot leave its group, and its group went with it."""
    wait_all(refs, timeout, "sync")


def collect(refs: dict[int, Any], timeout: float, what: str) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every call up to the deadline: ({key: result}, {key: why it failed})."""
    outcomes = dict(zip(refs, wait_all(list(refs.values()), timeout, what)))
    return ({key: o.value for key, o in outcomes.items() if o.ok},
            {key: o.error for key, o in outcomes.items() if not o.ok})


TRANSPORTS: dict[str, type] = {"object_store": ObjectStoreTransport, "collective": CollectiveTransport}


def make_transport(config: SyncConfig, publisher: Any, timeout: float) -> WeightTransport:
    """The transport `config.transport` names, loading from `publisher` (the learner's rank-0 actor) with `timeout`
    seconds for every load."""
    return TRANSPORTS[config.transport](config, publisher, timeout)
