"""Faults through the real loop. A rollout worker process killed mid-generation and a worker that hangs past its
deadline are replaced, given the current weights, and their prompts re-dispatched: the run's rewards are exactly
those of a run without the fault (same seeds), so nothing is lost. A non-finite update is skipped and counted, K in a
row stop the run. A killed frozen reference is restarted and the run is the one without the fault; a killed learner
stops the run with one line and the checkpoint to resume from."""

from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import threading
import time

import pytest
import ray

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.run.launch import run_training
from sync.calls import RunError
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting workers travel by value


def _first(marker: str) -> bool:
    """True for exactly one caller over all processes: workers reach their faulty call at the same moment."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class OnceFaultyWorker(RolloutWorker):
    """Fails once in the whole run (a marker file, shared by every replacement, records that it did), on the
    `fail_on`-th generate call of the first worker process."""

    marker = ""
    fail_on = 2
    mode = "kill"

    def generate(self, prompts, seeds, sampling, *load, **probe):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.fail_on and _first(self.marker):
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-generation, as an OOM kill would
            time.sleep(3600)  # a hung engine
        return super().generate(prompts, seeds, sampling, *load, **probe)


def faulty(tmp_path, mode):
    return type(f"{mode.title()}OnceWorker", (OnceFaultyWorker,), {"marker": str(tmp_path / f"{mode}.marker"),
                                                                   "mode": mode})


def run(tmp_path, model_dir, name, rollout_cls=None, *overrides):
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=4",
                                "data.prompts_per_step=8", "rollout.num_workers=2", *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False, pool=POOL, rollout_cls=rollout_cls)


@pytest.fixture(scope="module")
def clean_run(ray_local, tmp_path_factory, demo_model_dir):
    return run(tmp_path_factory.mktemp("clean"), demo_model_dir, "clean")


# Without the probe, the 2nd generate call also carries the load of weights version 1 (RolloutPool.sync): a worker
# killed there must not cost its load either.
@pytest.mark.parametrize("mode, probe", [("kill", False), ("hang", True)])
def test_failed_worker_is_replaced_and_nothing_is_lost(ray_local, tmp_path, demo_model_dir, clean_run, mode, probe):
    worker_cls = faulty(tmp_path, mode)
    records = run(tmp_path, demo_model_dir, mode, worker_cls, "timeouts.generate=5", f"sync.probe={probe}")
    assert (tmp_path / f"{mode}.marker").exists()  # the fault happened
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # Every worker fails on its 2nd call; the first to get there is replaced once (the marker stops the others).
    assert records[-1]["rollout/restarts"] == 1 and records[0]["rollout/restarts"] == 0
    # time/recovery is per step: the seconds spent replacing workers in the step that had the fault, 0 in the others.
    faulted = next(i for i, r in enumerate(records) if r["rollout/restarts"] == 1)
    assert records[faulted]["time/recovery"] > 0
    assert all(r["time/recovery"] == 0 for i, r in enumerate(records) if i != faulted)
    # The replacement got the current weights and the re-dispatched prompts the same seeds: the same run.
    assert [r["reward/mean"] for r in records] == [r["reward/mean"] for r in clean_run]
    assert [r["response_length/mean"] for r in records] == [r["response_length/mean"] for r in clean_run]
    assert all(r["logprob/mismatch"] < 1e-4 for r in records)


_samples_scored = itertools.count()


def overflowing_reward(completion, label):
    """1e39 is a finite Python float but inf in the learner's float32: the advantages, then the loss, are NaN."""
    return 1e39


def overflowing_reward_in_step_1(completion, label):
    return 1e39 if next(_samples_scored) < 8 * 8 else float(completion == label)  # 8 prompts x G = 8 in step 1


def test_a_non_finite_update_is_skipped_and_counted_and_the_run_goes_on(ray_local, tmp_path, demo_model_dir):
    records = run(tmp_path, demo_model_dir, "nan_once", None, "max_steps=3", "rollout.num_workers=1",
                  f"reward.sources.c.verifier={__name__}:overflowing_reward_in_step_1")
    assert [r["train/skipped_updates"] for r in records] == [1, 0, 0]
    assert [r["grad_norm"] for r in records][0] == 0 and records[1]["grad_norm"] > 0
    # The skipped update left the weights alone: engines and learner still agree exactly after every sync.
    assert all(r["logprob/mismatch"] < 1e-4 and r["sync/probe_max_diff"] < 1e-4 for r in records)


def test_non_finite_updates_in_a_row_stop_the_run_with_one_line(ray_local, tmp_path, demo_model_dir):
    with pytest.raises(RunError, match=r"learner failed during 'train': NonFiniteError: 2 updates in a row had a "
                                       r"non-finite loss or gradient; lower learner.lr or check the rewards; "
                                       r"no checkpoint was written yet$"):
        run(tmp_path, demo_model_dir, "nan", None, "max_steps=5", "rollout.num_workers=1",
            "learner.max_nonfinite_steps=2", f"reward.sources.c.verifier={__name__}:overflowing_reward")


def kill_actor_process(class_name: str, when, timeout: float = 300, killed: list | None = None) -> threading.Thread:
    """From a thread: once `when()` holds, SIGKILL the Ray worker process hosting `class_name` (its process title is
    `ray::<class_name>...`), as an OOM kill or a lost node would; the pids it killed go to `killed`. Only this
    session's Ray's processes (this process's descendants): other Ray instances on the machine are not ours."""
    import psutil

    def killer():
        deadline = time.monotonic() + timeout
        while not when() and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in psutil.Process(os.getpid()).children(recursive=True):
            try:
                if any(part.startswith(f"ray::{class_name}") for part in proc.cmdline()):
                    proc.kill()
                    (killed if killed is not None else []).append(proc.pid)
            except psutil.Error:  # gone meanwhile
                continue

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return thread


def steps_recorded(metrics) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_a_killed_reference_is_restarted_and_the_run_is_the_one_without_the_fault(ray_local, tmp_path,
                                                                                 demo_model_dir, clean_run):
    # The frozen reference's process dies (SIGKILL, as an OOM kill would) after step 2: Ray restarts it in its bundle
    # and runs its call again (cluster/fleet/placement.py, RESTARTS). A fleet of its own (no pool): a restarted
    # process runs the constructor it was first started with, which a pooled fleet may have re-initialised since.
    killed: list[int] = []
    thread = kill_actor_process("ReferenceWorker", lambda: steps_recorded(tmp_path / "ref" / "metrics.jsonl") >= 2,
                                killed=killed)
    config = load_config(None, [f"run_dir={tmp_path / 'ref'}", f"model.path={demo_model_dir}", "max_steps=4",
                                "data.prompts_per_step=8", "rollout.num_workers=2"])
    records = run_training(config, tmp_path / "ref", str(demo_model_dir), display=False)
    thread.join(timeout=60)
    assert killed  # the fault happened
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("reward/mean", "kl/mean", "response_length/mean", "loss/policy"):  # the same run, bit for bit
        assert [r[key] for r in records] == [r[key] for r in clean_run], key


def test_a_dead_learner_stops_the_run_with_a_checkpoint_to_resume(ray_local, tmp_path, demo_model_dir):
    class_name, phase = "Learner", "train|sync"
    metrics = tmp_path / "dead" / "metrics.jsonl"
    thread = kill_actor_process(class_name, lambda: steps_recorded(metrics) >= 3)
    started = time.monotonic()
    with pytest.raises(RunError) as err:
        run(tmp_path, demo_model_dir, "dead", None, "max_steps=40", "rollout.num_workers=1", "checkpoint.every=2")
    thread.join(timeout=60)
    message = str(err.value)
    assert re.search(rf"^learner died during '({phase})'", message), message
    assert re.search(r"resume from step_\d+ with: relay train run_dir=.* resume=auto$", message), message
    assert "\n" not in message and time.monotonic() - started < 300
