"""Fleets kept between the tests' runs: `ParkingPool`, and the test session's one pool (`POOL`).

Owns: keeping a finished run's fleet parked and giving it to the next run of the same shape (`FleetShape`), its
actors re-initialised in place (`reinit_actor`; rollout actors as any `RolloutWorker` subclass: `PooledLauncher`,
tests/rehost.py), through `start_fleet`'s hook (`FleetPool`, cluster/fleet/placement.py).
Does not own: placing and starting actors (cluster/fleet/placement.py), what a run does with its fleet.

Consecutive runs of one shape in the modules that ask for the `fleets` fixture share their actor processes (each run
re-initialises them). tests/conftest.py clears `POOL` before every other test, so those find the cluster's resources
free, and at the end of the session. bench/fleet_pool.py measures what it saves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import ray

from cluster.config import RunConfig
from cluster.fleet.learner_group import LearnerGroup, rank_args
from cluster.fleet.placement import (
    CoreSpec,
    Fleet,
    RolloutLauncher,
    RolloutSlot,
    actor_env,
    connect_core,
    core_spec,
    launch_fleet,
    node_of,
    start_core,
    start_rollout_slots,
    stop_fleet,
)
from sync.calls import RunError, wait_all


class PooledLauncher(RolloutLauncher):
    """Starts rollout actors as `PooledRolloutWorker`s hosting this run's rollout class, so that a later run can
    re-initialise them as its own (`reinit`); `shape` is what the pool matches the fleet by."""

    def __init__(self, config: RunConfig, model_path: str, rollout_cls: type | None, shape: FleetShape | None):
        super().__init__(config, model_path, rollout_cls)
        self.shape = shape

    def actor(self) -> tuple[type, tuple]:
        from tests.rehost import PooledRolloutWorker

        return PooledRolloutWorker, (self.rollout_cls, *self.args())

    def concurrency_groups(self) -> dict[str, int]:
        """Always in-flight updates' group, so that a parked worker serves a run with or without them: a call outside
        the group runs in the actor's default group, one at a time, as in an actor without groups."""
        return {"weights": 1}

    def reinit(self, slots: list[RolloutSlot]) -> list[Any]:
        """Re-initialise pooled rollout actors in place as this launcher's workers (`reinit_as`); the calls' refs."""
        from tests.rehost import reinit_as

        return [s.actor.__ray_call__.remote(reinit_as, self.rollout_cls, *self.args(), **self.kwargs()) for s in slots]


@dataclass(frozen=True)
class FleetShape:
    """What a fleet's processes and placement groups are made of (`fleet_shape`). Two runs of one `core` can share
    the learner and reward-model processes, and the reference-model processes (`ReferenceWorker`s: the reference and
    the teacher) whose placement `seats` names, whichever role each had; of one `rollout` too, the rollout workers
    (as many as both have: the worker count is not part of it)."""

    core: tuple
    seats: tuple  # the placement of each ReferenceWorker the run has: the reference's, then the teacher's
    rollout: tuple


def fleet_shape(config: RunConfig, spec: CoreSpec) -> FleetShape | None:
    """The shape a `ParkingPool` matches fleets by; None for a fleet that cannot be re-initialised in place (sharded
    engines; the collective transport's groups). Learner ranks leave their process group when re-initialised
    (`reinit_actor`), and the run's `LearnerGroup.connect` forms a new one."""
    lc, rc, ro = config.learner, config.reference, config.rollout
    if ro.tensor_parallel_size > 1 or config.sync.transport != "object_store":
        return None

    def place(section: Any) -> tuple:
        return (section.num_cpus, section.num_gpus, section.num_threads,
                tuple(sorted((getattr(section, "resources", None) or {}).items())))

    where = (tuple(sorted(actor_env(0).items())), ray.get_runtime_context().get_job_id())
    reward_models = tuple((name, cls, place(config.reward.sources[name]))
                          for name, (cls, _, _) in spec.reward_models.items())
    return FleetShape(
        core=(place(lc), lc.num_ranks, reward_models, where),
        seats=((place(rc),) if config.uses_reference else ()) + ((place(config.teacher),) if config.uses_teacher
                                                                 else ()),
        rollout=(ro.placement, place(ro), tuple(sorted(ro.node_labels.items())), where))


def reinit_actor(instance: Any, *args: Any, **kwargs: Any) -> None:
    """Run inside an actor (`__ray_call__`): release what its object holds outside Python's memory (its `shutdown`,
    if any: an engine, a shared-memory buffer), drop its state, leave its process group (a learner rank's: the
    run's `LearnerGroup.connect` forms a new one) and run its constructor again with these arguments, as if the
    process had just started it."""
    import gc

    import torch.distributed as dist

    shutdown = getattr(instance, "shutdown", None)
    if shutdown is not None:
        shutdown()
    instance.__dict__.clear()
    if dist.is_initialized():
        gc.collect()  # the old ranks' sharded model goes before its group
        dist.destroy_process_group()
    type(instance).__init__(instance, *args, **kwargs)


class ParkingPool:
    """A `FleetPool` that keeps the fleet of a run that ended, so that the next run in this process whose fleet has
    the same shape (`fleet_shape`) starts from the same actor processes, re-initialised in place (`reinit_actor`):
    the processes' imports and the engines' start-up, most of a run's start, are skipped (docs/benchmarks.md), with
    the same results as on a fresh fleet (tests/cluster/test_fleet_pool.py). The learner and reward models are kept
    when their shape matches (`FleetShape.core`), and with them the reference-model processes, each taking the
    reference's or the teacher's role, whichever the run has, where the placement is the same (`FleetShape.seats`;
    one its run does not use waits, spare, in the fleet's placement group, for a later run); the rollout workers are
    kept when their shape matches too, whatever their class (its rollout actors can be re-initialised as any
    RolloutWorker subclass: tests/rehost.py). A different core, or a role without a process of its placement, stops
    the parked learner, reference-model processes and reward models first (and the rollout workers too unless their
    shape matches). A run whose fleet cannot be parked (`fleet_shape` None) gets a fresh one beside the parked
    fleet when the cluster's free CPUs hold it, and the parked one waits for the next run. The parked fleet holds its
    resources until taken or `clear`ed: use one pool for runs made one after the other, and `clear` it before anything
    else needs the cluster."""

    HEALTH_TIMEOUT = 10.0  # s: how long the actors of a failed run have to answer before they are parked
    STUCK_TIMEOUT = 2.0  # s: how long a failed run's rollout workers get to answer (to be kept), then to shut down

    def __init__(self) -> None:
        self.parked: Fleet | None = None
        # ReferenceWorkers in the parked fleet's placement group that no role of its run used: (placement, actor)
        self.spare: list[tuple[tuple, Any]] = []

    def take(self, config: RunConfig, model_path: str, rollout_cls: type | None) -> Fleet:
        """This run's fleet: as much of the parked one as its shape allows, re-initialised with this run's
        arguments (no longer parked; the rest of it is stopped), the rest started."""
        spec = core_spec(config, model_path)
        launcher = PooledLauncher(config, model_path, rollout_cls, fleet_shape(config, spec))
        parked, self.parked = self.parked, None
        if parked is not None and launcher.shape is None and self._fits_beside(config):
            # A fleet that cannot be parked itself starts beside the parked one, which the next run may still take.
            self.parked = parked
            return launch_fleet(config, model_path, launcher)
        if parked is not None:
            new, old = launcher.shape, parked.launcher.shape  # a parked fleet's is never None (`park`)
            keeps_rollout = new is not None and new.rollout == old.rollout
            self._admit(parked, config.rollout.num_workers - len(parked.rollout) if keeps_rollout else 0,
                        config.timeouts.start)
            seats = self._seats(parked, new) if new is not None and new.core == old.core else None
            if seats is not None:
                fleet = self._reinit(parked, keeps_rollout, launcher, spec, model_path, seats)
                if fleet is not None:
                    return fleet
            elif keeps_rollout:
                # A parked fleet of another core: its rollout workers may still serve, re-initialised (meanwhile the
                # core starts); the rest of it stops.
                count = config.rollout.num_workers
                kept, parked.rollout = parked.rollout[:count], parked.rollout[count:]
                self._stop(parked)
                return self._around(kept, launcher, model_path)
            else:
                self._stop(parked)
        return launch_fleet(config, model_path, launcher)

    def _seats(self, parked: Fleet, new: FleetShape) -> list[Any] | None:
        """The parked ReferenceWorkers (its run's reference and teacher, and the spare ones) that take the roles of
        `new.seats`, in its order, each of the same placement; the rest stay spare. None if a role has no such
        worker (the core then starts afresh)."""
        roles = [a for a in (parked.reference, parked.teacher) if a is not None]
        free = list(zip(parked.launcher.shape.seats, roles)) + self.spare
        taken = []
        for place in new.seats:
            match = next((seat for seat in free if seat[0] == place), None)
            if match is None:
                return None
            free.remove(match)
            taken.append(match[1])
        self.spare = free
        return taken

    def _reinit(self, fleet: Fleet, keep_rollout: bool, launcher: PooledLauncher, spec: CoreSpec, model_path: str,
                seats: list[Any]) -> Fleet | None:
        """The parked `fleet`'s learner and reward models run again with this run's arguments, and its `seats`
        (`_seats`) as its reference and teacher; its rollout workers too (as this run's rollout class) if
        `keep_rollout` (up to `num_workers` of them), the rest are stopped and started. If a parked actor died or a
        constructor raised (which then raises again on a fresh one): a new core around the rollout workers if they
        are up, else None (the fleet stopped)."""
        config = launcher.config
        ro = config.rollout
        keep = fleet.rollout[:ro.num_workers] if keep_rollout else []
        launcher.stop(fleet.rollout[len(keep):])
        fleet.rollout = [replace(slot, id=i) for i, slot in enumerate(keep)]
        fleet.launcher = launcher
        fleet.learner_group = LearnerGroup(fleet.learner_group.ranks, config.timeouts)
        restarts = [rank.__ray_call__.remote(reinit_actor, *rank_args(model_path, config.learner, i,
                                                                      **spec.rank_kwargs))
                    for i, rank in enumerate(fleet.learner_group.ranks)]
        restarts += launcher.reinit(keep)
        seats = iter(seats)
        fleet.reference = next(seats) if spec.reference is not None else None
        fleet.teacher = next(seats) if spec.teacher is not None else None
        if fleet.reference is not None:
            restarts.append(fleet.reference.__ray_call__.remote(reinit_actor, *spec.reference))
        if fleet.teacher is not None:
            restarts.append(fleet.teacher.__ray_call__.remote(reinit_actor, *spec.teacher))
        restarts += [fleet.reward_models[name].__ray_call__.remote(reinit_actor, *args, **kwargs)
                     for name, (_, args, kwargs) in spec.reward_models.items()]
        try:
            fleet.rollout += start_rollout_slots(launcher, list(range(len(keep), ro.num_workers)),
                                                 [s.node_id for s in keep])
        except BaseException:
            self._stop(fleet)
            raise
        try:
            outcomes = wait_all(restarts, config.timeouts.start, "start")
            if all(outcome.ok for outcome in outcomes):
                fleet.learner_group.connect()  # several ranks: a new process group
                return fleet
        except RunError:
            self._stop(fleet)
            return None
        except BaseException:
            self._stop(fleet)
            raise
        ranks = len(fleet.learner_group.ranks)
        # A parked actor died (or a constructor raised, which raises again on a fresh one). Rollout workers that are
        # up again serve a new core (`_around`); else the whole fleet starts afresh.
        kept = []
        if all(outcome.ok for outcome in outcomes[ranks:ranks + len(keep)]):
            kept, fleet.rollout = fleet.rollout, []
        self._stop(fleet)
        if not kept:
            return None
        # Already this run's workers: the new core needs only that they still answer.
        return self._around(kept, launcher, model_path, [slot.actor.__ray_ready__.remote() for slot in kept])

    @staticmethod
    def _around(kept: list[RolloutSlot], launcher: PooledLauncher, model_path: str,
                restarts: list[Any] | None = None) -> Fleet:
        """A new learner, reference and reward models around the `kept` rollout workers, re-initialised as this run's
        meanwhile (unless `restarts`, a call per kept worker, says they already are); a kept worker whose call fails
        (it died while parked) is stopped and replaced by a new one."""
        config = launcher.config
        restarts = launcher.reinit(kept) if restarts is None else restarts
        try:
            fleet = start_core(config, model_path, launcher)
        except BaseException:
            launcher.stop(kept, timeout=0)
            raise
        fleet.rollout = kept
        try:
            outcomes = wait_all(restarts, config.timeouts.start, "start")
            launcher.stop([slot for slot, outcome in zip(kept, outcomes) if not outcome.ok], timeout=0)
            fleet.rollout = [replace(slot, id=i) for i, slot in enumerate(
                slot for slot, outcome in zip(kept, outcomes) if outcome.ok)]
            fleet.rollout += start_rollout_slots(launcher, list(range(len(fleet.rollout), config.rollout.num_workers)),
                                                 [s.node_id for s in fleet.rollout])
            connect_core(fleet, config.timeouts.start)
        except BaseException:
            stop_fleet(fleet)  # release the placement groups and the actors that did start
            raise
        return fleet

    def park(self, fleet: Fleet, failed: bool = False) -> bool:
        """Keep `fleet` (one this pool's `take` gave; replacing any parked one) if its shape allows; returns whether it
        was kept. Workers still on their way in (`relay scale`) are parked with it, left to start: `take` adds those
        the next run needs (`_admit`). After a run that `failed`, those are stopped, a rollout worker is kept only if
        it answers within `STUCK_TIMEOUT` (one still in a call may be stuck: it has as long again to shut its engine
        down, then is killed; whatever state a kept one's fault left, re-initialising it replaces), and the other
        actors only if they answer within `HEALTH_TIMEOUT`."""
        if not isinstance(fleet.launcher, PooledLauncher) or fleet.launcher.shape is None:
            return False  # any parked fleet stays parked (`take` started this one beside it)
        spare, self.spare = self.spare, []  # this fleet's (`take` gave it)
        self.clear()
        self.spare = spare
        if failed:
            stale, fleet.pending = list(fleet.pending), []
            # Answering a no-op call in time: alive, and not busy with another call.
            idle = [outcome.ok for outcome in wait_all([slot.actor.__ray_ready__.remote() for slot in fleet.rollout],
                                                       self.STUCK_TIMEOUT, "park")]
            stale += [slot for slot, ok in zip(fleet.rollout, idle) if not ok]
            fleet.rollout = [slot for slot, ok in zip(fleet.rollout, idle) if ok]
            fleet.launcher.stop(stale, timeout=self.STUCK_TIMEOUT)
            actors = [fleet.learner, fleet.reference, fleet.teacher, *fleet.reward_models.values()]
            actors += [actor for _, actor in self.spare]
            try:
                ray.get([a.__ray_ready__.remote() for a in actors if a is not None], timeout=self.HEALTH_TIMEOUT)
            except Exception:  # dead, or still busy with a call of the failed run
                self.spare = []  # they go with the fleet's placement group
                return False
        self.parked = fleet
        return True

    @staticmethod
    def _fits_beside(config: RunConfig) -> bool:
        """Whether a fleet of `config` fits in the CPUs the cluster has free now (its GPUs and custom resources too,
        when it asks for any: then it does not, as a parked fleet is not worth the risk of waiting for them)."""
        from cluster.plan import cpus_asked

        sections = [config.learner, config.reference, config.rollout, config.teacher]
        if any(s.num_gpus or getattr(s, "resources", None) for s in sections):
            return False
        return ray.available_resources().get("CPU", 0.0) >= sum(cpus_asked(config).values()) + 1e-9

    @staticmethod
    def _admit(fleet: Fleet, needed: int, timeout: float) -> None:
        """The parked `fleet`'s workers that were on their way in when its run ended: up to `needed` of those whose
        engines were starting join its rollout workers once up (within `timeout` s: sooner than new ones would
        start), and the rest are stopped (an engine still starting is killed, not waited for)."""
        pending, fleet.pending = fleet.pending, []
        starting = [p for p in pending if p.actor is not None][:max(needed, 0)]
        outcomes = wait_all([p.actor.__ray_ready__.remote() for p in starting], timeout, "start")
        up = [p for p, outcome in zip(starting, outcomes) if outcome.ok]
        fleet.rollout += [RolloutSlot(p.id, p.actor, p.placement, node_of(p.placement)) for p in up]
        fleet.launcher.stop([p for p in pending if p not in up], timeout=0)

    def clear(self) -> None:
        """Stop the parked fleet, if any, releasing its resources."""
        parked, self.parked = self.parked, None
        if parked is not None:
            self._stop(parked)

    def _stop(self, fleet: Fleet) -> None:
        """Stop `fleet` and its spare ReferenceWorkers."""
        spare, self.spare = self.spare, []
        try:
            stop_fleet(fleet)
        finally:
            for _, actor in spare:
                ray.kill(actor)


POOL = ParkingPool()
