"""`relay submit` / `relay jobs` / `relay stop` against a Ray head this test starts on its own ports (through
`ray start --block` in its own process group) and stops itself: never `ray stop`, which would kill every Ray process
on the machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def relay(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*RELAY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


HEAD_ATTEMPTS = 3


@pytest.fixture(scope="module")
def ray_head(demo_model_dir):
    """A Ray head in its own process group (so this test process's own Ray instance is not involved), on free ports,
    with its own temp dir, shared by this module's tests; stopped by signalling its processes only."""
    from cluster.cli.jobs import client

    for attempt in range(1, HEAD_ATTEMPTS + 1):
        head, temp_dir, address, agent_port = start_head()
        try:
            # The Jobs API answers before the head's job agent is up; a job sent then is refused ("No available
            # agent"). An agent that lost a port race never comes up: start the head again on other ports.
            wait_until(head, lambda: socket.create_connection(("127.0.0.1", agent_port), timeout=1.0).close(),
                       f"nothing listens on the job agent's port {agent_port}", timeout=90)
            wait_until(head, lambda: client(address).list_jobs(), "the Jobs API does not answer", timeout=120)
        except (TimeoutError, RuntimeError):
            stop_head(head, temp_dir, keep_logs=attempt == HEAD_ATTEMPTS)
            if attempt == HEAD_ATTEMPTS:
                raise
            continue
        try:
            yield address
        finally:
            stop_head(head, temp_dir)
        return


def start_head() -> tuple[subprocess.Popen, str, str, int]:
    temp_dir = tempfile.mkdtemp(prefix="relay-head-", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs_port, dashboard_port, agent_port = free_port(), free_port(), free_port()
    # A job's entrypoint runs `python` from the head's PATH: on a real cluster, the image's Python with relay's
    # dependencies; here, this virtual environment's.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           # On SIGTERM Ray first drains the node (for Serve), waiting until every worker lease is returned or this
           # timeout passes; a stopped job's leftovers can hold one, so the teardown sat out the whole timeout. The
           # test's head serves nothing to drain: stop it at once.
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={gcs_port}",
         "--num-cpus=4", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard_port}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
         # Fixed by default: another Ray instance on this machine (the test session's own) holds them already, and
         # a head whose job agent cannot bind refuses every job ("No available agent").
         f"--dashboard-agent-listen-port={agent_port}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
         f"--ray-client-server-port={free_port()}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return head, temp_dir, f"http://127.0.0.1:{dashboard_port}", agent_port


def stop_head(head: subprocess.Popen, temp_dir: str, keep_logs: bool = False) -> None:
    """SIGTERM to `ray start --block` alone lets it stop its processes (no drain: `start_head`); signalling the whole
    group at once kills the GCS first and leaves it waiting to drain. Then SIGKILL whatever is left in the group."""
    try:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=40)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(timeout=30)
    if keep_logs:
        print(f"the test's Ray head logs are kept in {temp_dir}")
    else:
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_until(head: subprocess.Popen, check, what: str, timeout: float) -> None:
    """Call `check` until it stops raising (not up yet: connection refused, 5xx), the head exits, or `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"the test's Ray head exited with {head.returncode}")
        try:
            check()
            return
        except Exception as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test's Ray head: {what} after {timeout:.0f} s ({err})") from err
            time.sleep(0.5)


def test_submitted_demo_job_finishes_with_the_reward_rising(ray_head, tmp_path):
    run_dir = tmp_path / "run"
    result = relay("submit", "--address", ray_head, "max_steps=10", "rollout.num_workers=1", "ray.dashboard=false",
                   f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "SUCCEEDED" in result.stderr and "relay: run finished" in result.stdout  # the job's own log, streamed
    rewards = [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 10
    assert statistics.fmean(rewards[-3:]) > statistics.fmean(rewards[:3]) + 0.05, rewards

    listed = relay("jobs", "--address", ray_head)
    assert listed.returncode == 0 and "SUCCEEDED" in listed.stdout and "cluster.cli train" in listed.stdout


def test_a_submitted_job_can_be_stopped(ray_head, tmp_path):
    result = relay("submit", "--address", ray_head, "--no-wait", "max_steps=500", "rollout.num_workers=1",
                   "ray.dashboard=false", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    job_id = result.stdout.strip().splitlines()[-1]
    stopped = relay("stop", job_id, "--address", ray_head)
    assert stopped.returncode == 0 and f"stopping job {job_id}" in stopped.stderr
    deadline = time.monotonic() + 60
    while (status := job_status(ray_head, job_id)) != "STOPPED" and time.monotonic() < deadline:
        time.sleep(1.0)
    assert status == "STOPPED"


def job_status(address: str, job_id: str) -> str:
    listed = relay("jobs", "--address", address)
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if line.startswith(job_id)]
    assert len(rows) == 1, listed.stdout
    return next(word for word in ("PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED") if word in rows[0])


def test_bad_submissions_fail_here_with_one_line(tmp_path):
    no_address = relay("submit", "--address", "127.0.0.1:8265", "max_steps=1", f"run_dir={tmp_path}/r")
    assert no_address.returncode == 2 and "is not the cluster's Jobs API URL" in no_address.stderr
    relative = relay("submit", "--address", "http://127.0.0.1:9", "max_steps=1", "run_dir=runs/x")
    assert relative.returncode == 2 and "needs run_dir=ABSOLUTE_PATH" in relative.stderr
    bad_key = relay("submit", "--address", "http://127.0.0.1:9", "learner.lrr=1")
    assert bad_key.returncode == 2 and "unknown config key 'learner.lrr'" in bad_key.stderr
    for result in (no_address, relative, bad_key):
        assert result.stderr.strip().count("\n") == 0
