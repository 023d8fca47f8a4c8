"""Load balancing across rollout workers of different speeds, through the real loop: a slow worker is given fewer
prompts than a fast one, and which worker serves a prompt does not change the run (one sampling seed per prompt)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below travels by value


class OneSlowWorker(RolloutWorker):
    """The first worker process to start is 1 s slower per request; every worker logs each request it serves."""

    log = ""

    def __init__(self, settings, num_threads=1, fingerprint=True):
        super().__init__(settings, num_threads, fingerprint)
        try:
            os.close(os.open(self.log + ".slow", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            self.speed = "slow"
        except FileExistsError:
            self.speed = "fast"

    def generate(self, prompts, seeds, sampling, *load, **probe):
        if self.speed == "slow":
            time.sleep(1.0)
        with open(self.log, "a") as out:
            out.write(f"{self.speed} {len(prompts)}\n")
        return super().generate(prompts, seeds, sampling, *load, **probe)


def run(tmp_path, model_dir, name, balance):
    log = tmp_path / f"{name}.log"
    worker_cls = type("Logged", (OneSlowWorker,), {"log": str(log)})
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=3",
                                "data.prompts_per_step=16", "rollout.num_workers=2",
                                f"rollout.balance={balance}", "checkpoint.every=0"])
    records = run_training(config, tmp_path / name, str(model_dir), display=False, pool=POOL, rollout_cls=worker_cls)
    served = {"slow": 0, "fast": 0}
    for line in log.read_text().splitlines():
        speed, prompts = line.split()
        served[speed] += int(prompts)
    return records, served


def test_slow_worker_serves_fewer_prompts_and_the_split_does_not_change_the_run(ray_local, tmp_path, demo_model_dir):
    balanced, served = run(tmp_path, demo_model_dir, "balanced", "speed")
    even, even_served = run(tmp_path, demo_model_dir, "even", "even")
    # 3 steps x 16 prompts. Even split: 8 each per step. By speed: 8 each in step 1 (nothing measured yet); then the
    # slow worker (> 1 s a request) measured at under 1/5 of the fast one's speed (~0.1 s) gets at most 3 of 16.
    assert even_served == {"slow": 24, "fast": 24}
    assert served["slow"] + served["fast"] == 48 and served["slow"] <= 8 + 3 + 3, served
    assert [r["reward/mean"] for r in balanced] == [r["reward/mean"] for r in even]
    assert [r["loss/policy"] for r in balanced] == [r["loss/policy"] for r in even]
