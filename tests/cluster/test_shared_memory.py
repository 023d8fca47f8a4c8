"""`sync.shared_memory` through the real loop: a worker that cannot open the learner's buffer (as from another PID
namespace) stops the run with one line naming the switch, and with the switch off the same worker trains through
Ray's object store with the engines verified after every sync. (The default path, shared memory on one node, is
what every other test of tests/cluster runs; workers on other nodes, the object store, in test_multinode.py.)"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import ray

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.run.launch import run_training
from sync.calls import RunError
from sync.shared_memory import SharedWeightsHandle
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below travels by value


class ForeignWorker(RolloutWorker):
    """Sees the learner's buffer under a pid that does not exist here, as a process in another PID namespace would."""

    def load_weights(self, version, *buckets):
        if len(buckets) == 1 and isinstance(buckets[0], SharedWeightsHandle):
            buckets = (dataclasses.replace(buckets[0], pid=2**22 + 1),)  # beyond the kernel's pid_max
        return super().load_weights(version, *buckets)


def run(tmp_path, model_dir, name, *overrides):
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=2",
                                "data.prompts_per_step=4", "rollout.num_workers=1", "rollout.max_restarts=1",
                                *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False, pool=POOL, rollout_cls=ForeignWorker)


def test_a_worker_that_cannot_open_the_learners_buffer_stops_the_run_naming_the_switch(ray_local, tmp_path,
                                                                                      demo_model_dir):
    with pytest.raises(RunError) as err:
        run(tmp_path, demo_model_dir, "foreign")
    message = str(err.value)
    assert "cannot open the learner's shared weights" in message and "set sync.shared_memory=false" in message
    assert "\n" not in message


def test_with_shared_memory_off_the_same_worker_trains_through_the_object_store(ray_local, tmp_path, demo_model_dir):
    records = run(tmp_path, demo_model_dir, "object-store", "sync.shared_memory=false")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["sync/probe_max_diff"] < 1e-4 and r["logprob/mismatch"] < 1e-4 for r in records)
    assert records[-1]["rollout/restarts"] == 0
