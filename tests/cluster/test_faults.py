"""Rollout faults through the real loop: a worker process killed mid-generation and a worker that hangs past its
deadline are replaced, given the current weights, and their prompts re-dispatched; the run's rewards are exactly
those of a run without the fault (same seeds), so nothing is lost."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.driver import run_training

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting workers travel by value


class OnceFaultyWorker(RolloutWorker):
    """Fails once in the whole run (a marker file, shared by every replacement, records that it did), on the
    `fail_on`-th generate call of the first worker process."""

    marker = ""
    fail_on = 2
    mode = "kill"

    def generate(self, prompts, seeds, sampling):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.fail_on and not Path(self.marker).exists():
            Path(self.marker).write_text(str(os.getpid()))
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-generation, as an OOM kill would
            time.sleep(3600)  # a hung engine
        return super().generate(prompts, seeds, sampling)


def faulty(tmp_path, mode):
    return type(f"{mode.title()}OnceWorker", (OnceFaultyWorker,), {"marker": str(tmp_path / f"{mode}.marker"),
                                                                   "mode": mode})


def run(tmp_path, model_dir, name, rollout_cls=None, *overrides):
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=4",
                                "data.prompts_per_step=8", "rollout.num_workers=2", *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False, rollout_cls=rollout_cls)


@pytest.fixture(scope="module")
def clean_run(ray_local, tmp_path_factory, demo_model_dir):
    return run(tmp_path_factory.mktemp("clean"), demo_model_dir, "clean")


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_failed_worker_is_replaced_and_nothing_is_lost(ray_local, tmp_path, demo_model_dir, clean_run, mode):
    worker_cls = faulty(tmp_path, mode)
    records = run(tmp_path, demo_model_dir, mode, worker_cls, "timeouts.generate=10")
    assert (tmp_path / f"{mode}.marker").exists()  # the fault happened
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # Every worker fails on its 2nd call; the first to get there is replaced once (the marker stops the others).
    assert records[-1]["rollout/restarts"] == 1 and records[0]["rollout/restarts"] == 0
    assert records[-1]["time/recovery"] > 0
    # The replacement got the current weights and the re-dispatched prompts the same seeds: the same run.
    assert [r["reward/mean"] for r in records] == [r["reward/mean"] for r in clean_run]
    assert [r["response_length/mean"] for r in records] == [r["response_length/mean"] for r in clean_run]
    assert all(r["logprob/mismatch"] < 1e-4 for r in records)
