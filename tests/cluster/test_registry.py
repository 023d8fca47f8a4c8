"""The cluster's run registry (cluster/fleet/control.py) on the session's real Ray: runs join it by their run_dir's
name, a second run of a going run's name is refused (after a grace), `relay scale` / `relay status` find a run by
name (or the only one), and a run whose driver was killed without leaving is noticed gone by its token (an object the
dead driver owned), so that a run of its name started right after it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from cluster.fleet.control import NAME_GRACE, ControlError, call, find_run, run_name, start_control
from sync.calls import RunError

ROOT = Path(__file__).resolve().parents[2]

# A driver that joins the session's Ray, registers run "dead-driver", says so, and is SIGKILLed: it never leaves.
KILLED_DRIVER = """
import os, signal, sys
import ray
from cluster.fleet.control import start_control
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="WARNING")
start_control("/runs/dead-driver")
print("joined", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_runs_join_by_name_are_found_and_leave(ray_local, tmp_path):
    first = start_control(str(tmp_path / "reg-first"))
    try:
        asked = time.monotonic()
        with pytest.raises(RunError, match="^a run named 'reg-first' is already going on this Ray cluster; give this "
                                           "run another run_dir name$"):
            start_control(str(tmp_path / "elsewhere" / "reg-first"))
        assert time.monotonic() - asked >= NAME_GRACE  # tried again meanwhile: its driver might have just died
        assert find_run(None).name == "reg-first"  # the only run going
        second = start_control(str(tmp_path / "reg-second"))
        with pytest.raises(ControlError, match=r"2 relay runs are going on this cluster \(reg-first, reg-second\)"):
            find_run(None)
        with pytest.raises(ControlError, match="no relay run named 'reg-third' on this cluster; running: reg-first"):
            find_run("reg-third")
        ray.get(second.publish({"step": 1, "workers": [{"id": 0, "node_id": "n"}, {"id": 1, "node_id": "n"}]}))
        handle = find_run("reg-second")
        assert call(handle.request_scale(3)) == {"run_dir": str(tmp_path / "reg-second"), "workers_now": 2,
                                                 "num_workers": 3, "remove": []}
        with pytest.raises(ControlError, match="no rollout worker with id 7"):  # checked against the published fleet
            call(handle.request_scale(None, [7]))
        assert call(handle.status())["pending"] == {"num_workers": 3, "remove": []}
        assert ray.get(second.take_request()) == {"num_workers": 3, "remove": []}
        second.leave()
        with pytest.raises(ControlError, match="no relay run named 'reg-second'"):
            call(handle.status())  # a handle found before the run ended
    finally:
        first.leave()
    with pytest.raises(ControlError, match="no relay run is going on this cluster"):
        find_run(None)
    start_control(str(tmp_path / "reg-first")).leave()  # the name is free again


def test_a_killed_drivers_run_is_noticed_gone_and_its_name_freed(ray_local):
    driver = subprocess.run([sys.executable, "-c", KILLED_DRIVER, ray.get_runtime_context().gcs_address],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert driver.returncode == -signal.SIGKILL and driver.stdout.strip() == "joined", driver.stderr[-2000:]
    # Started at once: the name is taken only until Ray has noticed the driver gone, which the grace outlasts.
    start_control("/elsewhere/dead-driver").leave()
    assert run_name("/elsewhere/dead-driver") == "dead-driver"
