"""`sync.transport=collective` through the real loop: in one run a worker killed inside the broadcast and then one
that never takes part in it (it hits `timeouts.sync` instead of hanging the run) are replaced, the group re-formed each
time, and no prompt is lost. The verified-sync checks of the object-store transport hold at every step (the weights
version advances, `logprob/mismatch` and the probe stay ~0), and the run is, step by step, the fault-free run through
the object store: both transports hand the engines the learner's exact weights.

The collective run's fleet cannot be parked (its transport's groups: tests/fleets.py), so it starts beside the
session's parked fleet instead of taking it, and later modules still find that fleet parked."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # the fault-free run shares fleets (tests/fleets.py)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting workers travel by value

SAME_RUN_KEYS = ("reward/mean", "response_length/mean", "loss/policy", "weights/version")


def run(tmp_path, model_dir, name, transport, rollout_cls=None, *overrides):
    # 1 KB buckets: the demo model travels in ~26 broadcasts, so a failing member stops the others mid-way (with one
    # bucket a survivor's whole share often sits in its socket buffer already) and they are loaded again.
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=4",
                                "data.prompts_per_step=8", "rollout.num_workers=2", f"sync.transport={transport}",
                                "sync.bucket_mb=0.001", *overrides])
    # The object store's run on the session's pool; the collective one on a fleet of its own (`pool=None`).
    pool = POOL if transport == "object_store" else None
    return run_training(config, tmp_path / name, str(model_dir), display=False, pool=pool, rollout_cls=rollout_cls)


def _first(marker: str) -> bool:
    """True for exactly one caller over all processes."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class FaultyReceiver(RolloutWorker):
    """Once in the whole run each (marker files): the first worker to receive weights version 2 (step 2's sync) dies
    (SIGKILL, as an OOM kill would); the first to receive version 3 never takes part in the broadcast (a stalled
    engine). By version, not by call count: a survivor loaded again within the same sync must not count twice."""

    markers = ""

    def receive_weights(self, version):
        if version == 2 and _first(f"{self.markers}/kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if version == 3 and _first(f"{self.markers}/stall"):
            time.sleep(3600)
        return super().receive_weights(version)


@pytest.fixture(scope="module")
def fault_free_run(ray_local, tmp_path_factory, demo_model_dir):
    return run(tmp_path_factory.mktemp("object_store"), demo_model_dir, "fault_free", "object_store")


def test_members_that_die_or_stall_in_the_broadcast_are_replaced_and_nothing_is_lost(ray_local, tmp_path,
                                                                                   demo_model_dir, fault_free_run):
    worker_cls = type("FaultyReceiverHere", (FaultyReceiver,), {"markers": str(tmp_path)})
    records = run(tmp_path, demo_model_dir, "faulty", "collective", worker_cls, "timeouts.sync=8")
    assert (tmp_path / "kill").exists() and (tmp_path / "stall").exists()  # both faults happened
    # Killed in step 2's sync, stalled in step 3's: each replaced once, in that step (and no other restart: step 1's
    # and step 4's syncs are fault-free collective syncs).
    assert [r["rollout/restarts"] for r in records] == [0, 1, 2, 2]
    assert records[1]["time/recovery"] > 0
    assert 8 <= records[2]["time/sync"] < 8 + 60  # the stalled member cost the 8 s timeout, not a hang
    # Survivors were loaded again in a group of their own, replacements joined a re-formed group and got the current
    # weights (probe-checked): every step is the fault-free run's.
    assert all(r["logprob/mismatch"] < 1e-4 and r["sync/probe_max_diff"] < 1e-4 for r in records)
    assert [r["weights/version"] for r in records] == [1, 2, 3, 4]
    assert [r["weights/version"] for r in fault_free_run] == [1, 2, 3, 4]
    for key in SAME_RUN_KEYS:
        assert [r[key] for r in records] == [r[key] for r in fault_free_run], key
