"""Growing the rollout fleet never stalls training: `relay scale` asks for more workers than the cluster has room
for; the run keeps stepping at its pace with the workers it has, each new worker joins at the first step boundary
after it is placed and its engine is up (with the current weights, probe-checked), one whose engine fails to start is
dropped and counted, and the ones that do not fit stay pending, shown in metrics and `relay status`."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
import ray

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.fleet.control import ScaleRequests, find_run, run_name
from cluster.run.launch import run_training

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below travels by value


class ThirdStartFails(RolloutWorker):
    """The third rollout worker process to start raises in its constructor (an engine that cannot start); every
    request takes at least 0.3 s, so the run's steps last long enough for new engines to come up meanwhile."""

    markers = ""

    def __init__(self, settings, num_threads=1, fingerprint=True):
        number = 1
        while True:  # this process's start number, over all processes (marker files, created atomically)
            try:
                os.close(os.open(f"{self.markers}.{number}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                number += 1
        if number == 3:
            raise RuntimeError("injected: this engine cannot start")
        super().__init__(settings, num_threads, fingerprint)

    def generate(self, prompts, seeds, sampling, *load, **probe):
        time.sleep(0.3)
        return super().generate(prompts, seeds, sampling, *load, **probe)


def read(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hold_near_the_end(monkeypatch, run_dir, steps: int, workers: int, failures: int) -> list[int]:
    """The test waits on the state it checks, not on the run's length: at the step boundaries of the run's last 5 steps
    (where new workers join: `ScaleRequests.apply`), a run whose fleet has not reached `workers` serving and
    `failures` failed starts yet applies the boundary again until it has (at most 240 s), so a slow machine cannot end
    the run first. Returns the steps held: their time/step and time/scale hold the wait."""
    held: list[int] = []
    original = ScaleRequests.apply

    def apply(control: ScaleRequests) -> None:
        original(control)
        workers_now, step = control.rollouts.workers, len(read(run_dir)) + 1
        deadline = time.monotonic() + 240
        while (step > steps - 5 and time.monotonic() < deadline
               and (len(workers_now.slots) < workers or workers_now.failures < failures)):
            if step not in held:
                held.append(step)
            time.sleep(0.5)
            original(control)

    monkeypatch.setattr(ScaleRequests, "apply", apply)
    return held


def test_asking_for_more_workers_than_fit_keeps_training_and_adds_those_that_fit(ray_local, tmp_path, demo_model_dir,
                                                                                 monkeypatch):
    # ray_local has 4 CPUs: the learner takes 0.5 and each rollout worker 1, so 1 worker runs and 2 more fit. Asking
    # for 5: 2 are placed; one of them fails to start (counted), which frees room for a third; the last never fits.
    run_dir = tmp_path / "grow"
    worker_cls = type("Paced", (ThirdStartFails,), {"markers": str(tmp_path / "started")})
    # The last 5 steps wait for the workers (`hold_near_the_end`): the run need only outlast the request by a few
    # free steps, however long the engines take to come up.
    prompts, group, steps = 8, 4, 25
    config = load_config(None, [
        f"run_dir={run_dir}", f"model.path={demo_model_dir}", f"max_steps={steps}", f"data.prompts_per_step={prompts}",
        f"rollout.group_size={group}", "rollout.num_workers=1", "rollout.num_cpus=1", "learner.kl_coef=0",
        "checkpoint.every=0", "logging.tensorboard=false", "timeouts.start=120"])
    seen: dict = {}

    def operator() -> None:  # what a user does from another terminal: `relay scale`, then `relay status`
        try:
            while len(read(run_dir)) < 2:
                time.sleep(0.2)
            control = find_run(run_name(str(run_dir)))
            seen["reply"] = ray.get(control.request_scale(5), timeout=30)
            seen["asked_after"] = len(read(run_dir))
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                last = read(run_dir)[-1]
                if last["rollout/workers"] == 3 and last["rollout/scale_failures"] == 1:
                    seen["status"] = ray.get(control.status(), timeout=30)
                    return
                time.sleep(0.2)
        except Exception as err:  # reported by the assertions below
            seen["error"] = repr(err)

    held = hold_near_the_end(monkeypatch, run_dir, steps, workers=3, failures=1)
    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    records = run_training(config, run_dir, str(demo_model_dir), display=False, rollout_cls=worker_cls)
    thread.join(timeout=60)
    assert "error" not in seen and "status" in seen, seen
    assert seen["reply"]["num_workers"] == 5 and seen["reply"]["workers_now"] == 1

    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # Nothing stalled: the old behaviour waited timeouts.start (120 s) in the step that took the request.
    free = [r for r in records if r["step"] not in held]  # held steps waited for the state checked below
    assert len(free) >= steps - 5 and max(r["time/step"] for r in free) < 30, [round(r["time/step"], 1) for r in free]
    assert max(r["time/scale"] for r in free) < 10
    # Workers joined one by one at step boundaries, as they came up; the fleet never shrank.
    sizes = [r["rollout/workers"] for r in records]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 3
    assert records[-1]["rollout/scale_events"] == 2
    # One start failed (dropped, counted, named); one worker does not fit and stays pending, shown in status.
    last = records[-1]
    assert last["rollout/scale_failures"] == 1 and last["rollout/workers_pending"] == 1
    assert "failed to start" in seen["status"]["last_scale_error"]
    assert "injected: this engine cannot start" in seen["status"]["last_scale_error"]
    assert [w["state"] for w in seen["status"]["workers_pending"]] == ["placing"]
    assert len(seen["status"]["workers"]) == 3
    # Every step trained on all its prompts, and the new workers served the learner's weights from their first
    # request (the probe checked them before it; their rollouts' logprobs match the learner's).
    assert all(r["rollout/completions"] == prompts * group for r in records)
    assert all(r["weights/version"] == r["step"] for r in records)
    assert max(r["logprob/mismatch"] for r in records) < 1e-4
    # The pending placement group was released with the run: the cluster's CPUs are free again.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == 4
