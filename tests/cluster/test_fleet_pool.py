"""`FleetPool`: a run that finished leaves its fleet parked; the next run of the same shape re-initialises those
actor processes in place and trains exactly as on a fresh fleet; another shape, a failed run or a run that started
its own Ray does not reuse it."""

from __future__ import annotations

import pytest
import ray
from safetensors.torch import load_file

from cluster.config import load_config
from cluster.fleet.placement import FleetPool
from cluster.run.driver import run_training
from sync.verify import SyncError

pytestmark = pytest.mark.slow
VOLATILE = ("time/", "throughput/", "memory/")  # wall clock, and the processes' peak memory


def train(tmp_path, model_dir, name, pool, *overrides, **kwargs):
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=2",
                                "data.prompts_per_step=8", "rollout.num_workers=1", *overrides])
    records = run_training(config, tmp_path / name, str(model_dir), display=False, pool=pool, **kwargs)
    weights = load_file(tmp_path / name / "checkpoints" / "step_2" / "policy" / "model.safetensors")
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records], weights


def parked_actors(pool: FleetPool) -> list:
    fleet = pool.parked[1]
    return [a for a in (fleet.learner, fleet.reference, *fleet.rollout_workers) if a is not None]


def actor_ids(pool: FleetPool) -> set[str]:
    return {actor._actor_id.hex() for actor in parked_actors(pool)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_reused_fleet_trains_exactly_as_a_fresh_one(ray_local, tmp_path, demo_model_dir, dtype):
    pool = FleetPool()
    try:
        fresh = train(tmp_path, demo_model_dir, "fresh", pool, f"model.dtype={dtype}")
        first = actor_ids(pool)
        # Another run on those processes (another learning rate and seed), then the first config again.
        train(tmp_path, demo_model_dir, "other", pool, f"model.dtype={dtype}", "learner.lr=1e-3", "seed=5")
        again = train(tmp_path, demo_model_dir, "again", pool, f"model.dtype={dtype}")
        assert actor_ids(pool) == first  # the same actors all along
        assert again[0] == fresh[0]
        assert again[1].keys() == fresh[1].keys()
        assert all((again[1][name] == fresh[1][name]).all() for name in fresh[1])
    finally:
        pool.clear()
    assert pool.parked is None


def test_another_shape_or_a_failed_run_starts_afresh(ray_local, tmp_path, demo_model_dir):
    from tests.cluster.test_loop import NoProbeWorker

    pool = FleetPool()
    try:
        train(tmp_path, demo_model_dir, "one", pool)
        one = parked_actors(pool)
        train(tmp_path, demo_model_dir, "two", pool, "rollout.num_workers=2")  # another shape: the first is stopped
        assert not actor_ids(pool) & {a._actor_id.hex() for a in one} and len(actor_ids(pool)) == 4
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(one[0].__ray_ready__.remote(), timeout=60)
        with pytest.raises(SyncError):  # a run that fails leaves nothing parked
            train(tmp_path, demo_model_dir, "bad", pool, rollout_cls=NoProbeWorker)
        assert pool.parked is None
    finally:
        pool.clear()
