"""The one place where relay's plain worker classes become Ray actors, and where they are placed.

Owns: the placement group (one bundle for the learner, one for the reference, one per rollout worker, each sized by
its own config section, so the rollout fleet scales independently of the learner), each actor's runtime environment
(thread counts, in-process vLLM), `ray.remote` wrapping, and a deadline-bounded `ray.get`.
Does not own: what a step does (cluster/driver.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import RunConfig


class RunError(RuntimeError):
    """The run cannot go on; the message is one line for the user."""


@dataclass
class Fleet:
    """Handles to every actor of a run."""

    learner: Any
    reference: Any | None
    rollout_workers: list[Any]
    placement: PlacementGroup
    reward_models: dict[str, Any] = field(default_factory=dict)  # source name -> RewardModelWorker
    start_rollout_worker: Any = None  # (index) -> a new rollout actor in worker `index`'s bundle
    restarts: int = 0  # rollout workers replaced so far

    @property
    def rollout_names(self) -> list[str]:
        """How errors and metrics name each rollout worker, by index."""
        return [f"rollout worker {i}" for i in range(len(self.rollout_workers))]


def _env(threads: int) -> dict[str, str]:
    env = {
        "OMP_NUM_THREADS": str(threads),
        # The engine runs inside the actor's process: weights are handed over as tensors and start-up is fast.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key in ("VLLM_CACHE_ROOT", "RELAY_CACHE_DIR", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _bundle(num_cpus: float, num_gpus: float) -> dict[str, float]:
    bundle = {"CPU": num_cpus}
    if num_gpus:
        bundle["GPU"] = num_gpus
    return bundle


def start_fleet(config: RunConfig, model_path: str, rollout_cls: type | None = None) -> Fleet:
    """Reserve resources for every actor in one placement group and start them (engines load their model).

    `rollout_cls` replaces `RolloutWorker` (a subclass with injected faults, in the tests)."""
    from actors.engine import EngineSettings
    from actors.reference import ReferenceWorker
    from actors.reward_model import RewardModelWorker
    from actors.rollout import RolloutWorker
    from cluster.config import ModelSource
    from learner.learner import Learner

    rollout_cls = rollout_cls or RolloutWorker
    lc, rc, ro = config.learner, config.reference, config.rollout
    bundles = [_bundle(lc.num_cpus, lc.num_gpus)]
    if config.uses_reference:
        bundles.append(_bundle(rc.num_cpus, rc.num_gpus))
    bundles += [_bundle(ro.num_cpus, ro.num_gpus) for _ in range(ro.num_workers)]
    reward_sources = {name: s for name, s in config.reward.sources.items() if isinstance(s, ModelSource)}
    bundles += [_bundle(s.num_cpus, s.num_gpus) for s in reward_sources.values()]
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=config.timeouts.start)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise RunError(f"Ray could not reserve {bundles} within timeouts.start={config.timeouts.start:g} s; "
                       "lower rollout.num_workers or the num_cpus/num_gpus of learner, reference or rollout") from None

    def options(index: int, threads: int, cpus: float, gpus: float) -> dict[str, Any]:
        return {"num_cpus": cpus, "num_gpus": gpus, "runtime_env": {"env_vars": _env(threads)},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}

    learner = ray.remote(Learner).options(**options(0, lc.num_threads, lc.num_cpus, lc.num_gpus)).remote(
        model_path, lc, config.model.dtype, ro.temperature, config.seed, config.critic, ro.max_new_tokens)
    reference = None
    if config.uses_reference:
        reference = ray.remote(ReferenceWorker).options(**options(1, rc.num_threads, rc.num_cpus, rc.num_gpus)).remote(
            model_path, config.model.dtype, rc.num_threads, rc.micro_batch_size, ro.temperature)
    first = 2 if config.uses_reference else 1
    settings = EngineSettings(model_path=model_path, dtype=config.model.dtype, max_model_len=ro.max_model_len,
                              kv_cache_bytes=ro.kv_cache_bytes, enforce_eager=ro.enforce_eager,
                              gpu_memory_utilization=ro.gpu_memory_utilization, seed=config.seed)
    rollout_first = first

    def start_rollout_worker(index: int) -> Any:
        return ray.remote(rollout_cls).options(**options(rollout_first + index, ro.num_threads, ro.num_cpus,
                                                         ro.num_gpus)).remote(settings, ro.num_threads)

    workers = [start_rollout_worker(i) for i in range(ro.num_workers)]
    first += ro.num_workers
    reward_models = {
        name: ray.remote(RewardModelWorker).options(**options(first + i, s.num_threads, s.num_cpus, s.num_gpus)).remote(
            s.path, config.model.dtype, s.num_threads, s.micro_batch_size)
        for i, (name, s) in enumerate(reward_sources.items())
    }
    fleet = Fleet(learner, reference, workers, pg, reward_models, start_rollout_worker)
    names = (["learner"] + (["reference"] if reference else []) + fleet.rollout_names
             + [f"reward model '{name}'" for name in reward_models])
    actors = [learner] + ([reference] if reference else []) + workers + list(reward_models.values())
    try:
        get([a.__ray_ready__.remote() for a in actors], config.timeouts.start, names, "start")
    except BaseException:
        stop_fleet(fleet)  # release the placement group and the actors that did start
        raise
    return fleet


def get(refs: list, timeout: float, names: list[str], what: str) -> list:
    """`ray.get` with a deadline; a missed deadline or a dead actor becomes a RunError naming the actor."""
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        late = [name for ref, name in zip(refs, names) if ref not in ready]
        raise RunError(f"{', '.join(late)} missed the {timeout:g} s deadline of '{what}' "
                       f"(raise timeouts.{what} if the work is legitimately slow)") from None
    except RayActorError as err:
        raise RunError(f"an actor died during '{what}': {err.__class__.__name__}: "
                       f"{str(err).splitlines()[0]}") from err
    except RayTaskError as err:  # the call raised inside the actor: its own message, not Ray's traceback wall
        cause = err.cause if err.cause is not None else err
        raise RunError(f"{', '.join(names)} failed during '{what}': {cause.__class__.__name__}: "
                       f"{str(cause).splitlines()[0] if str(cause) else ''}") from err


def stop_fleet(fleet: Fleet) -> None:
    """Shut the engines down before killing their actors (else vLLM leaves files in /dev/shm and the temp dir)."""
    try:
        ray.wait([w.shutdown.remote() for w in fleet.rollout_workers], num_returns=len(fleet.rollout_workers),
                 timeout=10)
    finally:
        for actor in [fleet.learner, fleet.reference, *fleet.rollout_workers, *fleet.reward_models.values()]:
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(fleet.placement)
