"""A run across a simulated 3-node Ray cluster (`ray.cluster_utils.Cluster`, one machine): the learner and reference
on the node with the `learner_node` resource, rollout workers spread over the two `rollout_node` nodes; while it
runs, `relay scale` adds a worker and removes another. Each change takes effect at the next step, the new worker
serves the current weights (the probe checks it before its first request, and its rollouts' logprobs match the
learner's), and no prompt is lost.

The run and the `relay` commands are separate processes, as for a user; the cluster is this test's own (its nodes
are stopped with it: never `ray stop`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sync.startup import LABELS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]


def env() -> dict[str, str]:
    # Read at call time: the cluster's auth mode (set in `three_nodes`) must reach the `relay` processes.
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_args(resources: dict[str, float], **extra) -> dict:
    # Each node's agents get their own ports: the defaults are fixed, and this machine runs other Ray instances.
    return {"num_cpus": 1, "resources": resources, "object_store_memory": 200 * 2**20,
            "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(),
            "runtime_env_agent_port": free_port(), **extra}


@pytest.fixture
def three_nodes():
    from ray.cluster_utils import Cluster

    # RAY_AUTH_MODE=token is pinned in tests/conftest.py: the nodes and the `relay` processes agree on it.
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args=node_args({"learner_node": 1}, include_dashboard=False))
    rollout_nodes = [cluster.add_node(**node_args({"rollout_node": 4})) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster.address, cluster.head_node.node_id, {n.node_id for n in rollout_nodes}
    cluster.shutdown()
    # Cluster.shutdown resets this process's client of Ray's key-value store, which the session's Ray (`ray_local`)
    # still has: the runs after this test read their actors' start-up marks through it (cluster/run/startup.py).
    import ray

    if ray.is_initialized():
        from ray.experimental import internal_kv

        internal_kv._initialize_internal_kv(ray._private.worker.global_worker.gcs_client)


def relay(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RELAY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env())


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(run: subprocess.Popen, run_dir: Path, condition, what: str, timeout: float = 300) -> dict:
    """The first metrics record meeting `condition`, waiting for the run to write it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in records(run_dir) if condition(r)]
        if found:
            return found[0]
        if run.poll() is not None:
            pytest.fail(f"the run ended (exit {run.returncode}) before {what}: {run.stderr.read()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"no step with {what} within {timeout} s")


def status(address: str) -> dict:
    result = relay("status", "--address", address)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def startup_status(run: subprocess.Popen, address: str, timeout: float = 300) -> dict:
    """`relay status`'s `startup` while the run's actors start (before: no run, or an earlier phase)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.poll() is not None:
            pytest.fail(f"the run ended (exit {run.returncode}) during start-up: {run.stderr.read()[-3000:]}")
        result = relay("status", "--address", address)
        startup = json.loads(result.stdout).get("startup", {}) if result.returncode == 0 else {}
        if startup.get("phase") == "actors":
            return startup
        time.sleep(0.5)
    pytest.fail(f"`relay status` showed no start-up's actors phase within {timeout} s")


def test_run_across_three_nodes_grows_and_shrinks_with_relay_scale(three_nodes, tmp_path, demo_model_dir):
    address, head_node, rollout_nodes = three_nodes
    run_dir = tmp_path / "multinode"
    prompts, group = 8, 4
    run = subprocess.Popen(
        [*RELAY, "train", "--quiet", f"model.path={demo_model_dir}", f"run_dir={run_dir}", f"ray.address={address}",
         "max_steps=1000", f"data.prompts_per_step={prompts}", f"rollout.group_size={group}",
         "rollout.num_workers=2", "rollout.placement=spread", "rollout.resources={rollout_node: 1}",
         "learner.resources={learner_node: 0.5}", "reference.resources={learner_node: 0.5}",
         "checkpoint.every=0", "logging.tensorboard=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env())
    try:
        # During start-up (with --quiet too), `relay status` shows its phase and each actor's state.
        starting = startup_status(run, address)
        assert starting["phase"] == "actors" and starting["seconds"] > 0, starting
        assert set(starting["actors"]) == {"learner", "reference", "rollout worker 0", "rollout worker 1"}, starting
        assert set(starting["actors"].values()) <= set(LABELS.values()), starting
        wait_for(run, run_dir, lambda r: r["step"] >= 2, "step 2")
        before = status(address)
        assert "startup" not in before  # the steps' status replaces start-up's
        assert before["learner_node"] == head_node
        assert [w["id"] for w in before["workers"]] == [0, 1]
        assert {w["node_id"] for w in before["workers"]} == rollout_nodes  # spread: one on each rollout node
        bad = relay("scale", "--remove-worker", "7", "--address", address)  # checked against the published fleet
        assert bad.returncode == 2 and "no rollout worker with id 7" in bad.stderr

        added = relay("scale", "--rollout-workers", "3", "--address", address)
        assert added.returncode == 0 and "2 -> 3 rollout workers" in added.stderr, added.stderr
        grown = wait_for(run, run_dir, lambda r: r["rollout/workers"] == 3, "3 workers")
        assert grown["rollout/scale_events"] == 1

        removed = relay("scale", "--remove-worker", "0", "--address", address)
        assert removed.returncode == 0 and "3 -> 2 rollout workers, removing workers [0]" in removed.stderr
        shrunk = wait_for(run, run_dir, lambda r: r["step"] > grown["step"] and r["rollout/workers"] == 2,
                          "2 workers again")
        after = status(address)
        assert [w["id"] for w in after["workers"]] == [1, 2]
        assert {w["node_id"] for w in after["workers"]} <= rollout_nodes

        # Steps no longer wait for new workers, so the run is stopped here rather than given a step count it might
        # finish before the test is done with it (SIGINT: Ctrl-C, the run stops after the step it is in).
        wait_for(run, run_dir, lambda r: r["step"] >= shrunk["step"] + 2, "two steps after the shrink")
        run.send_signal(signal.SIGINT)  # the run stops between two steps and cleans up
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 130 and "relay: run stopped: interrupted (Ctrl-C) after step" in stderr, stderr
    finally:
        if run.poll() is None:
            run.kill()
    lines = records(run_dir)
    last = lines[-1]["step"]
    assert [r["step"] for r in lines] == list(range(1, last + 1))
    # Nothing lost: every step trained on all its prompts' groups, whatever the fleet size.
    assert all(r["rollout/completions"] == prompts * group for r in lines)
    # Each change took effect at exactly one step boundary, and the weights never lagged behind the learner:
    # the new worker's rollouts (steps after `grown`) have behaviour logprobs equal to the learner's.
    sizes = [r["rollout/workers"] for r in lines]
    assert sizes == ([2] * (grown["step"] - 1) + [3] * (shrunk["step"] - grown["step"])
                     + [2] * (last - shrunk["step"] + 1))
    assert all(r["weights/version"] == r["step"] for r in lines)
    assert max(r["logprob/mismatch"] for r in lines) < 1e-4
