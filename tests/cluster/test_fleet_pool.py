"""`ParkingPool` (tests/fleets.py): a run leaves its fleet parked; the next run of the same shape re-initialises those
actor processes in place and trains exactly as on a fresh fleet. Rollout workers beyond a run's number are stopped,
missing ones added, and kept ones re-initialised as the run's rollout class, while the learner and reference are kept
(the reference's process serving as a teacher, or waiting for a run with a reference, when a run has no reference);
a failed run parks the rollout workers that answer; another learner or reference shape starts those afresh (and keeps
the rollout workers), and so does a parked learner or reference that died."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import ray
from safetensors.torch import load_file

from cluster.config import load_config
from cluster.run.launch import run_training
from sync.verify import SyncError
from tests.fleets import ParkingPool

pytestmark = pytest.mark.slow
VOLATILE = ("time/", "throughput/", "memory/")  # wall clock, and the processes' peak memory


def train(tmp_path, model_dir, name, pool, *overrides, **kwargs):
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=2",
                                "data.prompts_per_step=8", "rollout.num_workers=1", *overrides])
    records = run_training(config, tmp_path / name, str(model_dir), display=False, pool=pool, **kwargs)
    weights = load_file(tmp_path / name / "checkpoints" / "step_2" / "policy" / "model.safetensors")
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records], weights


def parked_actors(pool: ParkingPool) -> list:
    fleet = pool.parked
    return [a for a in (fleet.learner, fleet.reference, *fleet.rollout_workers) if a is not None]


def actor_ids(pool: ParkingPool) -> set[str]:
    return {actor._actor_id.hex() for actor in parked_actors(pool)}


def worker_ids(pool: ParkingPool) -> set[str]:
    return {actor._actor_id.hex() for actor in pool.parked.rollout_workers}


def assert_same_run(ours, theirs):
    assert ours[0] == theirs[0]
    assert ours[1].keys() == theirs[1].keys()
    assert all((ours[1][name] == theirs[1][name]).all() for name in theirs[1])


@contextmanager
def cleared_on_failure(pool: ParkingPool):
    """A test that fails leaves nothing parked (whatever it left may be half re-initialised); one that passes leaves
    its last run's fleet parked for the next run on the session's pool, which would otherwise start a fresh one."""
    try:
        yield
    except BaseException:
        pool.clear()
        raise


def assert_stopped(actors):
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=60)


# The run between: in float32 a distillation run without KL (the reference's process serves as its teacher), in
# bfloat16 a run without KL (no reference: its process waits, spare, for the next run that has one).
OTHER_ROLES = {"float32": ["learner.kl_coef=0", "learner.distill_coef=1", "teacher.path=demo"],
               "bfloat16": ["learner.kl_coef=0"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_reused_fleet_trains_exactly_as_a_fresh_one(fleets, tmp_path, demo_model_dir, dtype):
    """On the session's pool, emptied first: the first run starts a fresh fleet."""
    pool = fleets
    pool.clear()
    with cleared_on_failure(pool):
        fresh = train(tmp_path, demo_model_dir, "fresh", pool, f"model.dtype={dtype}")
        first = actor_ids(pool)
        reference = pool.parked.reference
        # Another run on those processes (another learning rate and seed, other roles for the reference's process),
        # then the first config again.
        train(tmp_path, demo_model_dir, "other", pool, f"model.dtype={dtype}", "learner.lr=1e-3", "seed=5",
              *OTHER_ROLES[dtype])
        assert pool.parked.reference is None
        if dtype == "float32":
            assert pool.parked.teacher._actor_id == reference._actor_id and not pool.spare
        else:
            assert pool.parked.teacher is None and [actor for _, actor in pool.spare] == [reference]
        again = train(tmp_path, demo_model_dir, "again", pool, f"model.dtype={dtype}")
        assert actor_ids(pool) == first and not pool.spare  # the same actors all along
        assert_same_run(again, fresh)


def test_the_learner_and_reference_outlive_other_rollout_workers_and_a_failed_run(fleets, tmp_path, demo_model_dir):
    """On the session's pool (its first run may take the fleet an earlier test parked: reused equals fresh, above)."""
    from tests.cluster.test_loop import NoProbeWorker

    pool = fleets
    with cleared_on_failure(pool):
        one = train(tmp_path, demo_model_dir, "one", pool)
        core, first = actor_ids(pool) - worker_ids(pool), worker_ids(pool)
        train(tmp_path, demo_model_dir, "two", pool, "rollout.num_workers=2")  # worker 0 kept, worker 1 added
        assert actor_ids(pool) - worker_ids(pool) == core and first < worker_ids(pool) and len(worker_ids(pool)) == 2
        two = list(pool.parked.rollout_workers)
        # Another kind of worker, in worker 0's process re-initialised as a NoProbeWorker (worker 1 is stopped: the run
        # has one): its override of `generate`, which Ray calls, is what runs, so the run fails.
        with pytest.raises(SyncError, match="probe"):
            train(tmp_path, demo_model_dir, "bad", pool, rollout_cls=NoProbeWorker)
        assert_stopped(two[1:])
        # A failed run parks the rollout workers that answer (not busy in a call), as they are: re-initialised next.
        assert actor_ids(pool) - worker_ids(pool) == core and worker_ids(pool) == {two[0]._actor_id.hex()}
        assert ray.get(two[0].__ray_call__.remote(lambda worker: type(worker).__name__)) == "NoProbeWorker"
        assert_same_run(train(tmp_path, demo_model_dir, "again", pool), one)  # a RolloutWorker again, as in run one
        assert actor_ids(pool) - worker_ids(pool) == core and worker_ids(pool) == {two[0]._actor_id.hex()}


def test_another_learner_shape_or_a_dead_parked_actor_starts_afresh(fleets, tmp_path, demo_model_dir):
    """On the session's pool (its first run may take the fleet the test above left parked)."""
    pool = fleets
    with cleared_on_failure(pool):
        one = train(tmp_path, demo_model_dir, "one", pool)
        before = parked_actors(pool)
        kept = worker_ids(pool)
        ray.kill(pool.parked.reference)  # dies while parked: the next run cannot re-initialise it
        assert_same_run(train(tmp_path, demo_model_dir, "again", pool), one)
        assert actor_ids(pool) & {a._actor_id.hex() for a in before} == kept  # a new core around the rollout worker
        assert_stopped([a for a in before if a._actor_id.hex() not in kept])
        again, workers = parked_actors(pool), worker_ids(pool)
        train(tmp_path, demo_model_dir, "threads", pool, "learner.num_threads=2")  # another learner shape (demo: 1)
        assert actor_ids(pool) & {a._actor_id.hex() for a in again} == workers  # only the rollout worker is kept
        assert_stopped([a for a in again if a._actor_id.hex() not in workers])
        assert_same_run(train(tmp_path, demo_model_dir, "back", pool), one)  # and back: the same run on that worker
