"""A run's start that fails (cluster/run/startup.py): the error's one line names the actor that did not start and its
log file (Ray's, from the actor's own start-up marks: sync/startup.py), where its traceback is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.run.launch import run_training
from sync.calls import RunError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the failing worker travels by value


class NoEngineWorker(RolloutWorker):
    """A rollout worker whose engine cannot start (a broken install, a model vLLM cannot load)."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("injected: this engine cannot start")


def test_an_actor_that_fails_to_start_is_named_with_its_log(ray_local, tmp_path, demo_model_dir):
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={demo_model_dir}", "max_steps=1",
                                "rollout.num_workers=1", "learner.kl_coef=0"])
    with pytest.raises(RunError) as failed:
        run_training(config, tmp_path / "run", str(demo_model_dir), display=False, rollout_cls=NoEngineWorker)
    message = str(failed.value)
    assert "rollout worker 0" in message and "\n" not in message
    # Ray's error names no actor for a death in a constructor: the one whose log holds the error is named, alone.
    assert "; rollout worker 0's log: " in message and "learner's log" not in message
    log = Path(message.split("; rollout worker 0's log: ")[1].split(";")[0])
    assert "injected: this engine cannot start" in log.read_text()
