"""Where the rollout, reference, teacher and reward-model workers become Ray actors, and where a run's workers are
placed.

Owns: placement (one placement group for the learner, reference, teacher and reward models; one per rollout worker,
sized by its own config section and placed on the nodes it allows, so the rollout fleet scales independently of the
learner, also while a run is going), each actor's runtime environment (thread counts, in-process vLLM), `ray.remote`
wrapping of the rollout, reference, teacher and reward-model workers, starting and stopping the fleet (`start_fleet`,
`stop_fleet`), the hook through which a pool of fleets kept between runs gives a run its fleet (`FleetPool`), and the
Ray settings of a Ray instance relay starts (`RAY_SYSTEM_CONFIG`).
Does not own: the learner's ranks as actors (cluster/fleet/learner_group.py, started here in the shared placement
group), the run registry (cluster/fleet/control.py), calling the actors (sync/calls.py), what a step does
(cluster/run/trainer.py), or keeping and re-initialising fleets between runs (the tests' pool: tests/fleets.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import RunConfig
from cluster.plan import core_bundles, rollout_bundles
from learner.config import LearnerConfig
from sync.calls import RunError, get

# Ray settings for a Ray instance relay starts itself (a cluster gets the same from RAY_<name> environment variables on
# every node: deploy/'s images set them). A rollout worker's reply (G completions x response tokens x ids and
# logprobs) returns inline to the driver up to 1 MiB, instead of through the object store above Ray's default 100 KB
# (docs/benchmarks.md, scale simulation).
RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": 1 << 20}
# Restarts of a frozen model's process (the reference without `refresh_every`, the teacher, a reward model not trained
# during the run) before a death stops the run; stateful ones (the learner, a refreshed reference, a trained reward
# model) stop it at the first, with the checkpoint to resume from.
RESTARTS = 3


@dataclass
class RolloutSlot:
    """One rollout worker: a stable id (its name in errors and metrics), its actor, and its own placement group."""

    id: int
    actor: Any
    placement: PlacementGroup
    node_id: str  # the Ray node its engine runs on
    name: str = field(init=False, repr=False)  # "rollout worker <id>", set once (errors name it in every check)

    def __post_init__(self):
        self.name = f"rollout worker {self.id}"


@dataclass(eq=False)
class PendingWorker:
    """A rollout worker on its way into the fleet: its placement group waits for room (Ray's autoscaler may be adding
    a node), then its engine starts; it joins at a step boundary once it is up (`RolloutWorkers.admit`,
    cluster/fleet/workers.py)."""

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
    teacher: Any | None = None  # on-policy distillation's teacher (a ReferenceWorker on the teacher's model)

    @property
    def rollout_workers(self) -> list[Any]:
        return [slot.actor for slot in self.rollout]

    @property
    def rollout_names(self) -> list[str]:
        """How errors and metrics name each rollout worker, by index."""
        return [slot.name for slot in self.rollout]


def actor_env(threads: int) -> dict[str, str]:
    """The environment variables every actor of a run starts with."""
    # Imported here, not above: the driver imports torch only to start actors.
    from learner.passes.device import CPU_BFLOAT16_MATMULS

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


def actor_runtime_env(threads: int, name: str | None = None) -> dict[str, Any]:
    """An actor's Ray runtime environment: `actor_env`, and with `name` (how the console and the start-up metrics
    call it) the start-up marks of sync/startup.py, the first made as its process starts (Ray's setup hook)."""
    if name is None:
        return {"env_vars": actor_env(threads)}
    from sync.startup import ENV

    env = {"env_vars": {**actor_env(threads), ENV: name}}
    try:  # an actor's own setup hook: only `ray.init` turns the `worker_process_setup_hook` key into what workers run
        from ray._private.runtime_env.setup_hook import export_setup_func_module
    except ImportError:  # another Ray: no `importing` mark (the console shows the actor starting until it loads)
        return env
    return export_setup_func_module(env, "sync.startup.process_started")


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
    bundles packed on one node, on the nodes the config allows (custom resources, node labels), packed or spread. With
    LoRA, each engine serves `max_loras` adapters at once under their own names (`relay serve`'s pools: several)."""

    SHUTDOWN_TIMEOUT = 10.0  # s: how long `stop` waits for the engines to shut down before it kills the actors

    def __init__(self, config: RunConfig, model_path: str, rollout_cls: type | None = None, max_loras: int = 1):
        from actors.engine import EngineSettings, LoraServing
        from actors.rollout import RolloutWorker

        self.config = config
        self.rollout_cls = rollout_cls or RolloutWorker
        ro, lora = config.rollout, config.learner.lora
        self.settings = EngineSettings(model_path=model_path, dtype=config.model.dtype,
                                       max_model_len=ro.max_model_len, kv_cache_bytes=ro.kv_cache_bytes,
                                       enforce_eager=ro.enforce_eager, gpu_memory_utilization=ro.gpu_memory_utilization,
                                       seed=config.seed, tensor_parallel_size=ro.tensor_parallel_size,
                                       cpu_linear=ro.cpu_linear,
                                       lora=LoraServing(lora.rank, lora.scale_alpha, tuple(lora_targets(
                                           config.learner, model_path)), max_loras) if lora.enabled else None)
        self.bundles = rollout_bundles(config)  # one per tensor-parallel shard (cluster/plan.py: `relay plan`'s)
        self.bundle = self.bundles[0]
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
        return [dict(b) for b in self.bundles], "STRICT_PACK", kwargs

    def start(self, pg: PlacementGroup, name: str | None = None) -> Any:
        """Start a rollout actor in `pg` (its engine starts loading; wait on `__ray_ready__`); `name`: its name in
        the start-up marks (`actor_runtime_env`), for a worker of the fleet's start.

        With tensor parallelism the actor itself holds no GPU: vLLM starts one Ray worker per shard in the
        placement group's bundles (captured as the actor's child tasks), and Ray gives each its own
        CUDA_VISIBLE_DEVICES."""
        ro = self.config.rollout
        sharded = ro.tensor_parallel_size > 1
        cls, args = self.actor()
        groups = self.concurrency_groups()
        actor = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
        return actor.options(
            num_cpus=ro.num_cpus, num_gpus=0 if sharded else ro.num_gpus,
            runtime_env=actor_runtime_env(ro.num_threads, name),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                                 placement_group_capture_child_tasks=sharded),
        ).remote(*args, **self.kwargs())

    def actor(self) -> tuple[type, tuple]:
        """The class Ray starts a worker as, and its positional arguments (with `kwargs`): `rollout_cls` and `args`.
        The tests' pool starts a class that can later become another rollout class instead (tests/fleets.py)."""
        return self.rollout_cls, self.args()

    def concurrency_groups(self) -> dict[str, int] | None:
        """The actor's concurrency groups: with in-flight updates, `offer_weights` runs in a thread of its own while
        `generate` runs."""
        return {"weights": 1} if self.config.rollout.in_flight_updates else None

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
            slots.append(RolloutSlot(worker_id, launcher.start(pg, f"rollout worker {worker_id}"), pg, busy[-1]))
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


class FleetPool(Protocol):
    """What `start_fleet` and `run_training` ask of a pool that keeps fleets between the runs of one process (the
    tests' pool, tests/fleets.py, re-initialises a finished run's actors for the next run: no new processes)."""

    def take(self, config: RunConfig, model_path: str, rollout_cls: type | None) -> Fleet | None:
        """This run's fleet, every actor up (`config` has `with_default_threads` applied); None: `start_fleet` starts
        one."""

    def park(self, fleet: Fleet, failed: bool = False) -> bool:
        """Offered the run's fleet when the run ends; whether the pool kept it (else the run stops it)."""


def start_fleet(config: RunConfig, model_path: str, rollout_cls: type | None = None,
                pool: FleetPool | None = None) -> Fleet:
    """Reserve resources (one placement group for learner, reference and reward models; one per rollout worker)
    and start every actor (engines load their model), unless `pool` gives a fleet (`FleetPool.take`).

    `rollout_cls` replaces `RolloutWorker` (a subclass with injected faults, in the tests)."""
    config = with_default_threads(config, model_path)
    fleet = pool.take(config, model_path, rollout_cls) if pool is not None else None
    if fleet is not None:
        return fleet
    return launch_fleet(config, model_path, RolloutLauncher(config, model_path, rollout_cls))


def launch_fleet(config: RunConfig, model_path: str, launcher: RolloutLauncher) -> Fleet:
    """A new fleet, its rollout workers started by `launcher` while the rest loads (`start_core`, `connect_core`);
    whatever started is stopped if any of it fails. `config` has `with_default_threads` applied."""
    fleet = start_core(config, model_path, launcher)
    try:
        fleet.rollout = start_rollout_slots(launcher, list(range(config.rollout.num_workers)), [])
        connect_core(fleet, config.timeouts.start)
    except BaseException:
        stop_fleet(fleet)  # release the placement groups and the actors that did start
        raise
    return fleet


@dataclass(frozen=True)
class CoreSpec:
    """What a run's learner ranks, reference and reward models are constructed with (`core_spec`)."""

    rank_kwargs: dict[str, Any]  # `launch_learner_group`'s and `rank_args`'s, besides the model path and config
    reference: tuple | None  # `ReferenceWorker`'s arguments; None for a run without a reference
    reward_models: dict[str, tuple[type, tuple, dict[str, Any]]]  # model source name -> class, args, kwargs
    teacher: tuple | None = None  # the teacher's `ReferenceWorker` arguments; None without distillation


def core_spec(config: RunConfig, model_path: str) -> CoreSpec:
    """The constructor arguments of the learner ranks, reference, teacher and reward models (`type: model` sources) of
    a run of `config` on the policy at `model_path`."""
    from actors.process_reward_model import ProcessRewardModelWorker
    from actors.reward_model import RewardModelWorker
    from learner.passes.sequences import MicroBatching
    from rewards.config import ModelSource

    rc, ro, tc = config.reference, config.rollout, config.teacher
    reference = (model_path, config.model.dtype, rc.num_threads,
                 MicroBatching(rc.micro_batch_size, rc.max_tokens_per_micro_batch, rc.share_prompts,
                               rc.pack_sequences),
                 ro.temperature)
    teacher = (teacher_path(tc.path), config.model.dtype, tc.num_threads,
               MicroBatching(tc.micro_batch_size, tc.max_tokens_per_micro_batch, tc.share_prompts, tc.pack_sequences),
               ro.temperature) if config.uses_teacher else None
    return CoreSpec(
        rank_kwargs=dict(dtype=config.model.dtype, temperature=ro.temperature, seed=config.seed,
                         critic=config.critic, norm_length=ro.max_new_tokens),
        reference=reference if config.uses_reference else None,
        # a process reward model (level steps) scores steps, a sequence classifier completions
        reward_models={name: (ProcessRewardModelWorker if s.level == "steps" else RewardModelWorker,
                              (s.path or model_path, config.model.dtype, s.num_threads,
                               MicroBatching(s.micro_batch_size, s.max_tokens_per_micro_batch)),
                              reward_model_training(s, config.seed))
                       for name, s in config.reward.sources.items() if isinstance(s, ModelSource)},
        teacher=teacher)


def teacher_path(path: str | None) -> str | None:
    """`teacher.path` as a directory: `demo` is relay's shipped demo teacher (`cluster.demo.cache`)."""
    if path != "demo":
        return path
    from cluster.demo.cache import demo_teacher_dir

    return str(demo_teacher_dir())


def start_core(config: RunConfig, model_path: str, launcher: RolloutLauncher) -> Fleet:
    """Reserve the shared placement group and start the learner's ranks, the reference and the reward models in it
    (their models start loading: `connect_core` waits for them); a fleet without rollout workers yet."""
    from actors.reference import ReferenceWorker
    from cluster.fleet.learner_group import launch_learner_group

    lc, rc, tc = config.learner, config.reference, config.teacher
    spec = core_spec(config, model_path)
    # The bundles `relay plan` shows (cluster/plan.py), in the order the actors below take them.
    bundles = [b for _, b in core_bundles(config)]
    pg = _reserve(bundles, "PACK", config.timeouts.start, "the learner, reference, teacher and reward models",
                  "lower the num_cpus/num_gpus of learner, reference or teacher, or check learner.resources")

    def options(index: int, threads: int, cpus: float, gpus: float, name: str, frozen: bool = False
                ) -> dict[str, Any]:
        # A frozen model holds nothing a restart would lose: Ray restarts its process in its bundle and runs the
        # calls it was running again (`RESTARTS`); the run goes on, its results the same.
        restarts = RESTARTS if frozen else 0
        return {"num_cpus": cpus, "num_gpus": gpus, "runtime_env": actor_runtime_env(threads, name),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
                "max_restarts": restarts, "max_task_retries": restarts}

    # No max_restarts on learner ranks: a restarted rank could not rejoin its process group.
    ranks = ["learner"] if lc.num_ranks == 1 else [f"learner rank {rank}" for rank in range(lc.num_ranks)]
    group = launch_learner_group([options(rank, lc.num_threads, lc.num_cpus, lc.num_gpus, ranks[rank])
                                  for rank in range(lc.num_ranks)], model_path, lc, **spec.rank_kwargs,
                                 timeouts=config.timeouts)
    first = lc.num_ranks
    reference = None
    if spec.reference is not None:
        reference = ray.remote(ReferenceWorker).options(**options(
            first, rc.num_threads, rc.num_cpus, rc.num_gpus, "reference", frozen=not rc.refresh_every)
        ).remote(*spec.reference)
        first += 1
    teacher = None
    if spec.teacher is not None:
        teacher = ray.remote(ReferenceWorker).options(**options(first, tc.num_threads, tc.num_cpus,
                                                                tc.num_gpus, "teacher", frozen=True)
                                                        ).remote(*spec.teacher)
        first += 1
    reward_models = {}
    for i, (name, (cls, args, kwargs)) in enumerate(spec.reward_models.items()):
        s = config.reward.sources[name]
        frozen = "training" not in kwargs  # not fine-tuned during the run
        reward_models[name] = ray.remote(cls).options(**options(first + i, s.num_threads, s.num_cpus, s.num_gpus,
                                                                f"reward model '{name}'", frozen=frozen)) \
            .remote(*args, **kwargs)
    return Fleet(group.rank0, reference, [], pg, launcher, reward_models, group, teacher=teacher)


def connect_core(fleet: Fleet, timeout: float) -> None:
    """Wait (up to `timeout` s) until the reference, teacher and reward models are up, then the learner's ranks, joined
    in their process group when there are several."""
    names = ((["reference"] if fleet.reference else []) + (["teacher"] if fleet.teacher else [])
             + [f"reward model '{name}'" for name in fleet.reward_models])
    actors = [a for a in (fleet.reference, fleet.teacher) if a] + list(fleet.reward_models.values())
    get([a.__ray_ready__.remote() for a in actors], timeout, names, "start")
    fleet.learner_group.connect()


def with_default_threads(config: RunConfig, model_path: str) -> RunConfig:
    """`config` with an unset `learner.num_threads` or `reference.num_threads` set by the policy's size
    (`learner.passes.device.default_threads`), and an unset `teacher.num_threads` as the reference's, so that the
    actors' environment, the fleet's shape and the actors agree."""
    from learner.passes.device import count_parameters, default_threads

    lc, rc, tc = config.learner, config.reference, config.teacher
    if lc.num_threads is not None and rc.num_threads is not None and tc.num_threads is not None:
        return config
    threads = default_threads(count_parameters(model_path))
    reference = rc.num_threads or threads
    return config.model_copy(update={"learner": lc.model_copy(update={"num_threads": lc.num_threads or threads}),
                                     "reference": rc.model_copy(update={"num_threads": reference}),
                                     "teacher": tc.model_copy(update={"num_threads": tc.num_threads or reference})})


def lora_targets(config: LearnerConfig, model_path: str | None) -> list[str]:
    """The module names `learner.lora.target_modules` resolves to on the policy at `model_path` (None: the demo's
    model, before it is built), from its config alone; ValueError (one line) for a name that matches no layer."""
    from transformers import AutoConfig

    from cluster.demo.model import tiny_qwen2_config
    from learner.lora import check_lora

    model_config = tiny_qwen2_config(vocab_size=64) if model_path is None else AutoConfig.from_pretrained(model_path)
    return check_lora(config.lora, model_config)


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
        for actor in [fleet.reference, fleet.teacher, *fleet.reward_models.values()]:
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(fleet.placement)
