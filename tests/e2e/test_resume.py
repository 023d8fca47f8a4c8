"""Exact resume after SIGKILL: the `relay` driver is killed while it writes a checkpoint, two steps past the last
complete one (synchronous), or with batches in flight (asynchronous), resumed with `resume=auto`, and ends with the
same metrics and bitwise the same weights as an uninterrupted run. Also: resuming a finished run exits 0 without
training; resuming with a config that changed the computation is refused. The uninterrupted runs and the resumptions
of the killed runs are made in the test's process (the same code and config as `relay train`; the run directory is
all a resumption reads). The killed drivers join the test session's Ray (`ray.address`, as on a cluster) rather than
start one each: a driver's death ends its Ray job, whose actors the cluster then stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cluster.config import load_config
from cluster.run import checkpoint
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]
STEPS = 6
ARGS = [f"max_steps={STEPS}", "checkpoint.every=2", "data.prompts_per_step=8", "rollout.num_workers=1",
        "ray.dashboard=false"]
TRAIN = ["train", "--quiet"]
# Wall-clock and process measurements differ between attempts; everything else must be equal.
VOLATILE = ("time/", "throughput/", "memory/")


def relay_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*RELAY, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def relay(*args: str) -> subprocess.CompletedProcess:
    process = relay_process(*args)
    out, err = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in lines]


def session_address() -> str:
    """The test session's Ray (`ray_local`), for a `relay` driver to join."""
    import ray

    return f"ray.address={ray.get_runtime_context().gcs_address}"


def kill_when(process: subprocess.Popen, condition, what: str) -> None:
    """SIGKILL the driver (only the driver: the cluster stops its Ray job's actors when it dies) once `condition()`
    holds."""
    deadline = time.monotonic() + 300
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended before {what}: {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)


def writing_checkpoint(run_dir: Path, step: int) -> bool:
    root = run_dir / checkpoint.CHECKPOINTS_DIR
    return root.exists() and any(p.name.startswith(f"{checkpoint.TMP_PREFIX}step_{step}-") for p in root.iterdir())


def final_weights(run_dir: Path) -> dict:
    return load_file(run_dir / checkpoint.CHECKPOINTS_DIR / f"step_{STEPS}" / checkpoint.POLICY_DIR /
                     "model.safetensors")


def train_here(run_dir: Path, *args: str) -> None:
    """The run `relay train run_dir=... *args` makes, made in this process (on the session's shared fleets)."""
    run_training(load_config(None, [f"run_dir={run_dir}", *args]), run_dir, display=False, pool=POOL)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_local, demo_model_dir):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    train_here(run_dir, *ARGS)
    return run_dir


def test_killed_mid_checkpoint_and_resumed_equals_the_uninterrupted_run(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    # Killed while the learner writes checkpoint step_4: steps 3 and 4 are recorded past the last complete checkpoint
    # (step_2), and step_4's temporary directory is left behind.
    process = relay_process(*TRAIN, f"run_dir={run_dir}", *ARGS, session_address())
    kill_when(process, lambda: writing_checkpoint(run_dir, 4), "the step_4 checkpoint write")
    assert checkpoint.latest(run_dir).name == "step_2"
    assert not (run_dir / checkpoint.CHECKPOINTS_DIR / "step_4").exists()
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]  # written (flushed) before each step's checkpoint
    # Resumed at once (the run registry notices the killed driver gone within a run's grace for a taken name), here
    # from what is on disk, as a new `relay` process would: runs steps 3-6 and finishes.
    train_here(run_dir, "resume=auto", *ARGS)

    assert records(run_dir) == records(uninterrupted)  # every step once, the same numbers
    ours, theirs = final_weights(run_dir), final_weights(uninterrupted)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert (ours[name] == theirs[name]).all(), f"{name} differs after resume"
    kept = sorted(p.name for p in (run_dir / checkpoint.CHECKPOINTS_DIR).iterdir())
    assert kept == ["step_4", "step_6"]  # checkpoint.keep=2, and no temporary directory left behind
    # The workers' measured speeds split the first resumed batch as they would have split it uninterrupted.
    state = checkpoint.read_driver_state(run_dir / checkpoint.CHECKPOINTS_DIR / "step_4")
    assert set(state["rollout_speeds"]) == {"0"} and state["rollout_speeds"]["0"] > 0


def test_resuming_a_finished_run_says_so_and_exits_0(uninterrupted):
    before = (uninterrupted / "metrics.jsonl").read_text()
    result = relay(*TRAIN, f"run_dir={uninterrupted}", "resume=auto", *ARGS)
    assert result.returncode == 0 and "already finished" in result.stderr + result.stdout
    assert (uninterrupted / "metrics.jsonl").read_text() == before


def test_resuming_with_a_changed_computation_is_refused(uninterrupted):
    result = relay(*TRAIN, f"run_dir={uninterrupted}", "resume=auto", *ARGS, "max_steps=8", "learner.lr=1e-3")
    assert result.returncode == 2
    assert "cannot resume" in result.stderr and "learner.lr" in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_asynchronous_run_killed_with_batches_in_flight_resumes_exactly(tmp_path, fleets):
    """`rollout.max_staleness=1`: the pipeline drains at checkpoint steps, so a run killed with batches in flight
    (after step 3: step 4's batch is out) and resumed from step_2 samples every batch with the same version as an
    uninterrupted run, and ends with the same metrics and bitwise the same weights."""
    args = [*ARGS, "rollout.max_staleness=1"]
    whole = tmp_path / "whole"
    train_here(whole, *args)
    assert [r["rollout/version"] for r in records(whole)] == [0, 0, 2, 2, 4, 4]  # drains at 2 and 4
    run_dir = tmp_path / "run"
    process = relay_process(*TRAIN, f"run_dir={run_dir}", *args, session_address())
    kill_when(process, lambda: len(records(run_dir)) >= 3, "step 3")
    assert checkpoint.latest(run_dir).name == "step_2"
    train_here(run_dir, "resume=auto", *args)
    assert records(run_dir) == records(whole)
    ours, theirs = final_weights(run_dir), final_weights(whole)
    assert ours.keys() == theirs.keys() and all((ours[name] == theirs[name]).all() for name in ours)
