"""Where the rollout, reference and reward-model workers become Ray actors, and where a run's workers are placed.

Owns: placement (one placement group for the learner, reference and reward models; one per rollout worker, sized by
its own config section and placed on the nodes it allows, so the rollout fleet scales independently of the learner,
also while a run is going), each actor's runtime environment (thread counts, in-process vLLM), `ray.remote` wrapping
of the rollout, reference and reward-model workers, starting and stopping the fleet (`start_fleet`, `stop_fleet`),
keeping a finished run's fleet for the next run of the same shape (`FleetPool`, `reinit_actor`), and the Ray
settings of a Ray instance relay starts (`RAY_SYSTEM_CONFIG`).
Does not own: the learner's ranks as actors (cluster/fleet/learner_group.py, started here in the shared placement
group), the control actor (cluster/fleet/control.py), calling the actors (sync/calls.py) or what a step does
(cluster/run/driver.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import RunConfig
from sync.calls import RunError, get, wait_all

# Ray settings for a Ray instance relay starts itself (a cluster gets the same from RAY_<name> environment variables on
# every node: deploy/'s images set them). A rollout worker's reply (G completions x response tokens x ids and
# logprobs) returns inline to the driver up to 1 MiB, instead of through the object store above Ray's default 100 KB
# (docs/benchmarks.md, scale simulation).
RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": 1 << 20}


@dataclass
class RolloutSlot:
    """One rollout worker: a stable id (its name in errors and metrics), its actor, and its own placement group."""

    id: int
    actor: Any
    placement: PlacementGroup
    node_id: str  # the Ray node its engine runs on

    @property
    def name(self) -> str:
        return f"rollout worker {self.id}"


@dataclass(eq=False)
class PendingWorker:
    """A rollout worker on its way into the fleet: its placement group waits for room (Ray's autoscaler may be adding
    a node), then its engine starts; it joins at a step boundary once it is up (`RolloutPool.admit`,
    cluster/fleet/rollout_pool.py)."""

    id: int
    placement: PlacementGroup
    placed: Any  # the placement group's `ready()` ref
    since: float  # time.monotonic() of the request, then of the engine's start
    actor: Any = None  # started once placed
    started: Any = None  # the actor's `__ray_ready__` ref

    @property
    def name(self) -> str:
        return f"rollout worker {self.id}"

    @property
    def state(self) -> str:
        return "placing" if self.actor is None else "starting"


@dataclass
class Fleet:
    """Handles to every actor of a run. The learner, reference and reward models share one placement group; each
    rollout worker has its own, so the fleet grows and shrinks without touching the others."""

    learner: Any  # rank 0's actor: the publisher the transports load from, and the learner's fingerprints
    reference: Any | None
    rollout: list[RolloutSlot]
    placement: PlacementGroup
    launcher: RolloutLauncher
    reward_models: dict[str, Any] = field(default_factory=dict)  # source name -> RewardModelWorker
    learner_group: Any = None  # cluster.fleet.learner_group.LearnerGroup: every rank (`learner` is rank 0's actor)
    pending: list[PendingWorker] = field(default_factory=list)  # asked for by `relay scale`, not yet serving
    shape: FleetShape | None = None  # `fleet_shape`: what a `FleetPool` matches it by

    @property
    def rollout_workers(self) -> list[Any]:
        return [slot.actor for slot in self.rollout]

    @property
    def rollout_names(self) -> list[str]:
        """How errors and metrics name each rollout worker, by index."""
        return [slot.name for slot in self.rollout]


def _env(threads: int) -> dict[str, str]:
    from learner.device import CPU_BFLOAT16_MATMULS  # here, not above: the driver imports torch only to start actors

    env = {
        "OMP_NUM_THREADS": str(threads),
        # The engine runs inside the actor's process: weights are handed over as tensors and start-up is fast.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key in ("VLLM_CACHE_ROOT", "RELAY_CACHE_DIR", "PYTHONPATH", CPU_BFLOAT16_MATMULS):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _bundle(num_cpus: float, num_gpus: float, resources: dict[str, float] | None = None) -> dict[str, float]:
    bundle = {"CPU": num_cpus, **(resources or {})}
    if num_gpus:
        bundle["GPU"] = num_gpus
    return bundle


def _reserve(bundles: list[dict[str, float]], strategy: str, timeout: float, what: str, fix: str,
             **kwargs: Any) -> PlacementGroup:
    pg = placement_group(bundles, strategy=strategy, **kwargs)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise RunError(f"Ray could not reserve {bundles} for {what} within timeouts.start={timeout:g} s; {fix}") \
            from None
    return pg


class RolloutLauncher:
    """Reserves, starts and stops rollout workers, each in its own placement group of `tensor_parallel_size`
    bundles packed on one node, on the nodes the config allows (custom resources, node labels), packed or spread."""

    SHUTDOWN_TIMEOUT = 10.0  # s: how long `stop` waits for the engines to shut down before it kills the actors

    def __init__(self, config: RunConfig, model_path: str, rollout_cls: type | None = None, pooled: bool = False):
        from actors.engine import EngineSettings
        from actors.rollout import RolloutWorker

        self.config = config
        self.rollout_cls = rollout_cls or RolloutWorker
        self.pooled = pooled  # actors a FleetPool may re-initialise as another rollout class (cluster/fleet/rehost.py)
        ro = config.rollout
        self.settings = EngineSettings(model_path=model_path, dtype=config.model.dtype,
                                       max_model_len=ro.max_model_len, kv_cache_bytes=ro.kv_cache_bytes,
                                       enforce_eager=ro.enforce_eager, gpu_memory_utilization=ro.gpu_memory_utilization,
                                       seed=config.seed, tensor_parallel_size=ro.tensor_parallel_size,
                                       cpu_linear=ro.cpu_linear)
        self.bundle = _bundle(ro.num_cpus, ro.num_gpus, ro.resources)
        self.episodes = None  # multi-turn episodes (`env`): what each worker needs to run them
        if config.env.enabled:
            from actors.episodes import EpisodeSettings

            self.episodes = EpisodeSettings(config.env, ro.max_turns, tuple(ro.stop), ro.max_model_len)

    def reserve(self, busy_nodes: list[str]) -> PlacementGroup:
        """A placement group for one more worker, waited for up to `timeouts.start`; with `placement=spread`,
        preferably on the fitting node that runs the fewest of `busy_nodes` (the nodes of the workers already running,
        with repeats)."""
        bundles, strategy, kwargs = self._request(busy_nodes)
        return _reserve(bundles, strategy, self.config.timeouts.start, "a rollout worker",
                        "add nodes with these resources, or lower rollout.num_workers, rollout.num_cpus/num_gpus "
                        "or rollout.resources", **kwargs)

    def place(self, busy_nodes: list[str]) -> PlacementGroup:
        """Like `reserve`, without waiting: Ray places the group when there is room. The node it hints (`spread`) is
        added to `busy_nodes`, so the next of several placed at once goes elsewhere."""
        bundles, strategy, kwargs = self._request(busy_nodes)
        if kwargs.get("_soft_target_node_id"):
            busy_nodes.append(kwargs["_soft_target_node_id"])
        return placement_group(bundles, strategy=strategy, **kwargs)

    def _request(self, busy_nodes: list[str]) -> tuple[list[dict[str, float]], str, dict[str, Any]]:
        ro = self.config.rollout
        kwargs: dict[str, Any] = {}
        if ro.node_labels:
            kwargs["bundle_label_selector"] = [dict(ro.node_labels)] * ro.tensor_parallel_size
        if ro.placement == "spread":
            # A soft hint (what Ray Serve uses to spread replicas): a full or dead node falls back to any other.
            kwargs["_soft_target_node_id"] = self._least_busy_node(busy_nodes)
        return [dict(self.bundle) for _ in range(ro.tensor_parallel_size)], "STRICT_PACK", kwargs

    def start(self, pg: PlacementGroup) -> Any:
        """Start a rollout actor in `pg` (its engine starts loading; wait on `__ray_ready__`).

        With tensor parallelism the actor itself holds no GPU: vLLM starts one Ray worker per shard in the
        placement group's bundles (captured as the actor's child tasks), and Ray gives each its own
        CUDA_VISIBLE_DEVICES."""
        ro = self.config.rollout
        sharded = ro.tensor_parallel_size > 1
        # In-flight updates: `offer_weights` runs in its own thread while `generate` runs.
        actor = (ray.remote(concurrency_groups={"weights": 1})(self.actor_cls) if ro.in_flight_updates else
                 ray.remote(self.actor_cls))
        args = (self.rollout_cls, *self.args()) if self.pooled else self.args()
        return actor.options(
            num_cpus=ro.num_cpus, num_gpus=0 if sharded else ro.num_gpus,
            runtime_env={"env_vars": _env(ro.num_threads)},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                                 placement_group_capture_child_tasks=sharded),
        ).remote(*args, **self.kwargs())

    @property
    def actor_cls(self) -> type:
        """The class Ray starts: `rollout_cls`, or for a pooled fleet the host of any rollout class."""
        if not self.pooled:
            return self.rollout_cls
        from cluster.fleet.rehost import PooledRolloutWorker

        return PooledRolloutWorker

    def reinit(self, slots: list[RolloutSlot]) -> list[Any]:
        """Re-initialise pooled rollout actors in place as this launcher's workers (`reinit_as`); the calls' refs."""
        from cluster.fleet.rehost import reinit_as

        return [s.actor.__ray_call__.remote(reinit_as, self.rollout_cls, *self.args(), **self.kwargs()) for s in slots]

    def args(self) -> tuple:
        """A rollout worker's constructor arguments (with `kwargs`)."""
        return self.settings, self.config.rollout.num_threads, self.config.sync.fingerprint

    def kwargs(self) -> dict[str, Any]:
        return {"episodes": self.episodes} if self.episodes is not None else {}  # a subclass may not take it

    def stop(self, slots: list[RolloutSlot] | list[PendingWorker], timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Shut the engines down (else vLLM leaves files in /dev/shm), kill the actors, release their resources.
        Pending workers too: an engine still starting shuts down once it is up, or is killed at the timeout."""
        started = [s for s in slots if s.actor is not None]
        try:
            if started:
                ray.wait([s.actor.shutdown.remote() for s in started], num_returns=len(started), timeout=timeout)
        finally:
            for slot in slots:
                if slot.actor is not None:
                    ray.kill(slot.actor)
                remove_placement_group(slot.placement)

    def _least_busy_node(self, busy_nodes: list[str]) -> str | None:
        ro = self.config.rollout
        fitting = [n["NodeID"] for n in ray.nodes()
                   if n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in self.bundle.items())
                   and all(n.get("Labels", {}).get(k) == v for k, v in ro.node_labels.items())]
        return min(fitting, key=busy_nodes.count) if fitting else None


def node_of(pg: PlacementGroup) -> str:
    """The node id of a placement group's first bundle."""
    return placement_group_table(pg)["bundles_to_node_id"][0]


def start_rollout_slots(launcher: RolloutLauncher, ids: list[int], busy_nodes: list[str]) -> list[RolloutSlot]:
    """Reserve and start one worker per id and wait until every engine is up (within `timeouts.start`)."""
    slots: list[RolloutSlot] = []
    busy = list(busy_nodes)
    try:
        for worker_id in ids:
            pg = launcher.reserve(busy)
            busy.append(node_of(pg))
            slots.append(RolloutSlot(worker_id, launcher.start(pg), pg, busy[-1]))
        get([s.actor.__ray_ready__.remote() for s in slots], launcher.config.timeouts.start,
            [s.name for s in slots], "start")
    except BaseException:
        launcher.stop(slots, timeout=0)
        raise
    return slots


def reward_model_training(source: Any, seed: int) -> dict[str, Any]:
    """`RewardModelWorker`'s training arguments for a `type: model` source that is fine-tuned during the run (none for
    a frozen one, or a process reward model)."""
    training = getattr(source, "train", None)
    if training is None:
        return {}
    return {"training": {"lr": training.lr, "loss": training.loss, "epochs": training.epochs,
                         "weight_decay": training.weight_decay, "max_grad_norm": training.max_grad_norm,
                         "seed": seed, "new_head": source.path is None}}


def start_fleet(config: RunConfig, model_path: str, rollout_cls: type | None = None,
                pool: FleetPool | None = None) -> Fleet:
    """Reserve resources (one placement group for learner, reference and reward models; one per rollout worker)
    and start every actor (engines load their model). With `pool`, a parked fleet of the same shape is taken
    instead and each of its actors re-initialised in place with this run's arguments (`FleetPool`).

    `rollout_cls` replaces `RolloutWorker` (a subclass with injected faults, in the tests)."""
    from actors.process_reward_model import ProcessRewardModelWorker
    from actors.reference import ReferenceWorker
    from actors.reward_model import RewardModelWorker
    from cluster.fleet.learner_group import LearnerGroup, launch_learner_group, rank_args
    from learner.algo.sequences import MicroBatching
    from rewards.config import ModelSource

    config = with_default_threads(config, model_path)
    lc, rc, ro = config.learner, config.reference, config.rollout
    launcher = RolloutLauncher(config, model_path, rollout_cls, pooled=pool is not None)
    reward_sources = {name: s for name, s in config.reward.sources.items() if isinstance(s, ModelSource)}
    rank_kwargs = dict(dtype=config.model.dtype, temperature=ro.temperature, seed=config.seed, critic=config.critic,
                       norm_length=ro.max_new_tokens)
    reference_args = (model_path, config.model.dtype, rc.num_threads,
                      MicroBatching(rc.micro_batch_size, rc.max_tokens_per_micro_batch, rc.share_prompts,
                                    rc.pack_sequences),
                      ro.temperature)
    reward_classes = {name: ProcessRewardModelWorker if s.level == "steps" else RewardModelWorker
                      for name, s in reward_sources.items()}
    reward_args = {name: ((s.path or model_path, config.model.dtype, s.num_threads,
                           MicroBatching(s.micro_batch_size, s.max_tokens_per_micro_batch)),
                          reward_model_training(s, config.seed)) for name, s in reward_sources.items()}
    shape = fleet_shape(config, launcher, reward_classes)
    fleet = pool.take(shape) if pool is not None else None
    if fleet is not None:
        # The parked fleet's learner, reference and reward models run again with this run's arguments; its rollout
        # workers too (as this run's rollout class) if their shape is this run's (up to `num_workers` of them), the
        # rest are stopped and started.
        keep = fleet.rollout[:ro.num_workers] if fleet.shape.rollout == shape.rollout else []
        launcher.stop(fleet.rollout[len(keep):])
        fleet.rollout = [replace(slot, id=i) for i, slot in enumerate(keep)]
        fleet.launcher, fleet.shape = launcher, shape
        fleet.learner_group = LearnerGroup(fleet.learner_group.ranks, config.timeouts)
        restarts = [fleet.learner.__ray_call__.remote(reinit_actor, *rank_args(model_path, lc, 0, **rank_kwargs))]
        restarts += launcher.reinit(keep)
        if fleet.reference is not None:
            restarts.append(fleet.reference.__ray_call__.remote(reinit_actor, *reference_args))
        restarts += [fleet.reward_models[name].__ray_call__.remote(reinit_actor, *args, **kwargs)
                     for name, (args, kwargs) in reward_args.items()]
        try:
            fleet.rollout += start_rollout_slots(launcher, list(range(len(keep), ro.num_workers)),
                                                 [s.node_id for s in keep])
        except BaseException:
            stop_fleet(fleet)
            raise
        try:
            get(restarts, config.timeouts.start, ["learner", *fleet.rollout_names[:len(keep)]] +
                (["reference"] if fleet.reference is not None else []) +
                [f"reward model '{name}'" for name in reward_args], "start")
            return fleet
        except RunError:  # a parked actor died (or a constructor raised, which then raises again below): start afresh
            stop_fleet(fleet)
        except BaseException:
            stop_fleet(fleet)
            raise

    # A parked fleet of another core: its rollout workers may still serve, re-initialised (meanwhile the core starts);
    # the rest of it stops.
    kept = pool.take_rollout(shape, ro.num_workers) if pool is not None else []
    restarts = launcher.reinit(kept)
    bundles = [_bundle(lc.num_cpus, lc.num_gpus, lc.resources) for _ in range(lc.num_ranks)]
    if config.uses_reference:
        bundles.append(_bundle(rc.num_cpus, rc.num_gpus, rc.resources))
    bundles += [_bundle(s.num_cpus, s.num_gpus) for s in reward_sources.values()]
    try:
        pg = _reserve(bundles, "PACK", config.timeouts.start, "the learner, reference and reward models",
                      "lower the num_cpus/num_gpus of learner or reference, or check learner.resources")
    except BaseException:
        launcher.stop(kept, timeout=0)
        raise

    def options(index: int, threads: int, cpus: float, gpus: float) -> dict[str, Any]:
        return {"num_cpus": cpus, "num_gpus": gpus, "runtime_env": {"env_vars": _env(threads)},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}

    # No max_restarts on learner ranks: a restarted rank could not rejoin its process group.
    group = launch_learner_group([options(rank, lc.num_threads, lc.num_cpus, lc.num_gpus)
                                  for rank in range(lc.num_ranks)], model_path, lc, **rank_kwargs,
                                 timeouts=config.timeouts)
    first = lc.num_ranks
    reference = None
    if config.uses_reference:
        reference = ray.remote(ReferenceWorker).options(**options(first, rc.num_threads, rc.num_cpus,
                                                                  rc.num_gpus)).remote(*reference_args)
        first += 1
    reward_models = {  # a process reward model (level steps) scores steps, a sequence classifier completions
        name: ray.remote(reward_classes[name]).options(**options(first + i, s.num_threads, s.num_cpus, s.num_gpus))
        .remote(*reward_args[name][0], **reward_args[name][1])
        for i, (name, s) in enumerate(reward_sources.items())
    }
    fleet = Fleet(group.rank0, reference, [], pg, launcher, reward_models, group, shape=shape)
    names = (["reference"] if reference else []) + [f"reward model '{name}'" for name in reward_models]
    actors = ([reference] if reference else []) + list(reward_models.values())
    fleet.rollout = kept
    try:
        # A kept worker that cannot be re-initialised (it died while parked) is stopped and replaced by a new one.
        outcomes = wait_all(restarts, config.timeouts.start, "start")
        launcher.stop([slot for slot, outcome in zip(kept, outcomes) if not outcome.ok], timeout=0)
        fleet.rollout = [replace(slot, id=i) for i, slot in enumerate(
            slot for slot, outcome in zip(kept, outcomes) if outcome.ok)]
        fleet.rollout += start_rollout_slots(launcher, list(range(len(fleet.rollout), ro.num_workers)),
                                             [s.node_id for s in fleet.rollout])
        get([a.__ray_ready__.remote() for a in actors], config.timeouts.start, names, "start")
        group.connect()  # the ranks are up and, with several, joined in their process group
    except BaseException:
        stop_fleet(fleet)  # release the placement groups and the actors that did start
        raise
    return fleet


def with_default_threads(config: RunConfig, model_path: str) -> RunConfig:
    """`config` with an unset `learner.num_threads` or `reference.num_threads` set by the policy's size
    (`learner.device.default_threads`), so that the actors' environment, the fleet's shape and the actors agree."""
    from learner.device import count_parameters, default_threads

    lc, rc = config.learner, config.reference
    if lc.num_threads is not None and rc.num_threads is not None:
        return config
    threads = default_threads(count_parameters(model_path))
    return config.model_copy(update={"learner": lc.model_copy(update={"num_threads": lc.num_threads or threads}),
                                     "reference": rc.model_copy(update={"num_threads": rc.num_threads or threads})})


@dataclass(frozen=True)
class FleetShape:
    """What a fleet's processes and placement groups are made of (`fleet_shape`). Two runs of one `core` can share
    the learner, reference and reward-model processes; of one `rollout` too, the rollout workers (as many as both
    have: the worker count is not part of it)."""

    core: tuple
    rollout: tuple


def fleet_shape(config: RunConfig, launcher: RolloutLauncher, reward_classes: dict[str, type]) -> FleetShape | None:
    """The shape a `FleetPool` matches fleets by; None for a fleet that cannot be re-initialised in place (several
    learner ranks: their process group; sharded engines; the collective transport's groups)."""
    lc, rc, ro = config.learner, config.reference, config.rollout
    if lc.num_ranks > 1 or ro.tensor_parallel_size > 1 or config.sync.transport != "object_store":
        return None

    def place(section: Any) -> tuple:
        return (section.num_cpus, section.num_gpus, section.num_threads,
                tuple(sorted((getattr(section, "resources", None) or {}).items())))

    where = (tuple(sorted(_env(0).items())), ray.get_runtime_context().get_job_id())
    return FleetShape(
        core=(place(lc), config.uses_reference, place(rc),
              tuple((name, cls, place(config.reward.sources[name])) for name, cls in reward_classes.items()), where),
        rollout=(launcher.actor_cls, ro.in_flight_updates, ro.placement, place(ro),
                 tuple(sorted(ro.node_labels.items())), where))


def reinit_actor(instance: Any, *args: Any, **kwargs: Any) -> None:
    """Run inside an actor (`__ray_call__`): release what its object holds outside Python's memory (its `shutdown`,
    if any: an engine, a shared-memory buffer), drop its state and run its constructor again with these
    arguments, as if the process had just started it."""
    shutdown = getattr(instance, "shutdown", None)
    if shutdown is not None:
        shutdown()
    instance.__dict__.clear()
    type(instance).__init__(instance, *args, **kwargs)


class FleetPool:
    """Keeps the fleet of a run that ended, so that the next run in this process whose fleet has the same shape
    (`fleet_shape`) starts from the same actor processes, re-initialised in place (`reinit_actor`): the processes'
    imports and the engines' start-up, most of a run's start, are skipped (docs/benchmarks.md), with
    the same results as on a fresh fleet (tests/cluster/test_fleet_pool.py). The learner, reference and reward models
    are kept when their shape matches (`FleetShape.core`), the rollout workers when theirs does too, whatever
    their class (a pooled fleet's rollout actors can be re-initialised as any RolloutWorker subclass:
    cluster/fleet/rehost.py); a different core stops the parked learner, reference and reward models first (and
    the rollout workers too unless their shape matches). The parked fleet holds its resources
    until taken or `clear`ed: use one pool for runs made one after the other (tests, sweeps, benchmarks), and
    `clear` it before anything else needs the cluster."""

    HEALTH_TIMEOUT = 10.0  # s: how long the actors of a failed run have to answer before they are parked
    STUCK_TIMEOUT = 2.0  # s: how long a failed run's rollout workers get to answer (to be kept), then to shut down

    def __init__(self) -> None:
        self.parked: Fleet | None = None

    def take(self, shape: FleetShape | None) -> Fleet | None:
        """The parked fleet if its core has this shape (no longer parked); else None (any parked fleet stays: see
        `take_rollout`)."""
        if self.parked is not None and shape is not None and self.parked.shape.core == shape.core:
            fleet, self.parked = self.parked, None
            return fleet
        return None

    def take_rollout(self, shape: FleetShape | None, count: int) -> list[RolloutSlot]:
        """Up to `count` of the parked fleet's rollout workers if theirs is this shape's rollout side (no longer
        parked); everything else parked is stopped."""
        parked, slots = self.parked, []
        if parked is not None and shape is not None and parked.shape.rollout == shape.rollout:
            slots, parked.rollout = parked.rollout[:count], parked.rollout[count:]
        self.clear()
        return slots

    def park(self, fleet: Fleet, failed: bool = False) -> bool:
        """Keep `fleet` (replacing any parked one) if its shape allows; returns whether it was kept. Workers still on
        their way in are stopped. After a run that `failed`, a rollout worker is kept only if it answers within
        `STUCK_TIMEOUT` (one still in a call may be stuck: it has as long again to shut its engine down, then is
        killed; whatever state a kept one's fault left, re-initialising it replaces), and the other actors only if
        they answer within `HEALTH_TIMEOUT`."""
        self.clear()
        if fleet.shape is None:
            return False
        stale, fleet.pending = list(fleet.pending), []
        if failed:
            # Answering a no-op call in time: alive, and not busy with another call.
            idle = [outcome.ok for outcome in wait_all([slot.actor.__ray_ready__.remote() for slot in fleet.rollout],
                                                       self.STUCK_TIMEOUT, "park")]
            stale += [slot for slot, ok in zip(fleet.rollout, idle) if not ok]
            fleet.rollout = [slot for slot, ok in zip(fleet.rollout, idle) if ok]
        fleet.launcher.stop(stale, timeout=self.STUCK_TIMEOUT if failed else fleet.launcher.SHUTDOWN_TIMEOUT)
        if failed:
            actors = [fleet.learner, fleet.reference, *fleet.reward_models.values()]
            try:
                ray.get([a.__ray_ready__.remote() for a in actors if a is not None], timeout=self.HEALTH_TIMEOUT)
            except Exception:  # dead, or still busy with a call of the failed run
                return False
        self.parked = fleet
        return True

    def clear(self) -> None:
        """Stop the parked fleet, if any, releasing its resources."""
        parked, self.parked = self.parked, None
        if parked is not None:
            stop_fleet(parked)


def check_reachable(address: str | None, timeout: float = 10.0) -> None:
    """Raise ConnectionError (within `timeout` s) when `address` is a cluster's GCS (`host:port`) that accepts no
    connection: `ray.init` would retry it for minutes. `auto`, `ray://` and malformed addresses are Ray's to judge."""
    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"nothing accepts connections at {address} ({err.strerror or err})") from None


def stop_fleet(fleet: Fleet) -> None:
    """Stop the rollout workers (engines first), then the other actors, and release every placement group."""
    try:
        fleet.launcher.stop([*fleet.rollout, *fleet.pending])
    finally:
        if fleet.learner_group is not None:
            fleet.learner_group.kill()
        for actor in [fleet.reference, *fleet.reward_models.values()]:
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(fleet.placement)
