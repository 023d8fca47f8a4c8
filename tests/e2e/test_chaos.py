"""bench/chaos.py at a small size, on one 4-step demo run (`relay train`, a checkpoint every 2 steps) scored by a tiny
frozen reward model beside a verifier served by `relay verifier serve`: the learner's process SIGKILLed after step 2,
or the driver's after step 1 (before any checkpoint), stops the run, and `relay train ... resume=auto` finishes it;
the reward model's process SIGKILLed is restarted by Ray, and the verifier service SIGKILLed and started again on its
port is retried by the client: that run (both faults in one) finishes by itself. Every step is recorded once, and
every step's reward, KL, loss and length are those of the run without the fault. A killed rollout worker or
reference: tests/cluster/test_faults.py. The environment service's kill: bench/chaos.py (docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.chaos import COMPARED, RETRIES, Service, killer, records, settings_args, train  # noqa: E402


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    service = Service(["verifier", "serve", "--verifier", "exact_match"], tmp_path_factory.mktemp("verifier") / "log")
    service.start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def args(verifier, tiny_reward_model_dir):
    judge = "reward.sources.judge"
    return [f"{judge}.type=remote", f"{judge}.urls=[{verifier.url}]", *(f"{judge}.{r}" for r in RETRIES),
            "reward.sources.rm.type=model", f"reward.sources.rm.path={tiny_reward_model_dir}",
            "reward.sources.rm.weight=0.1", *settings_args(workers=1, asynchronous=False, steps=4, overrides=[])]


@pytest.fixture(scope="module")
def clean(tmp_path_factory, args):
    run_dir = tmp_path_factory.mktemp("chaos") / "clean"
    assert train(run_dir, args) == 0
    return records(run_dir)


def assert_the_run_without_the_fault(run_dir: Path, clean: list[dict]) -> None:
    got = records(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all(r["verifier/failures"] == 0 and r["verifier/dropped_groups"] == 0 for r in got)
    for key in (*COMPARED, "reward/rm", "reward/judge"):
        assert [r[key] for r in got] == [r[key] for r in clean], key


# After step 2 the run has a checkpoint (every 2 steps) to resume from; after step 1 it has none, and resume=auto
# starts it again, the first attempt's records dropped (they were counted twice before).
@pytest.mark.parametrize("kind, after_step", [("learner", 2), ("driver", 1)])
def test_a_killed_learner_or_driver_resumes_to_the_run_without_the_fault(tmp_path, args, clean, kind, after_step):
    run_dir, killed = tmp_path / kind, []
    assert train(run_dir, args, kill=killer(kind, run_dir, after_step=after_step, delay=0.1, killed=killed)) != 0
    assert killed and len(records(run_dir)) < 4  # the fault happened, and stopped the run
    assert train(run_dir, args, resume=True) == 0
    assert_the_run_without_the_fault(run_dir, clean)


# One run, two faults: the frozen reward model's process, killed after step 1, is restarted by Ray, which runs its call
# again (cluster/fleet/placement.py, RESTARTS); the verifier service, killed after step 2 and down for its restart, is
# retried (RETRIES span it) and scores the same batch again. Neither stops the run.
def test_a_killed_reward_model_and_a_restarted_verifier_service_cost_nothing(tmp_path, args, clean, verifier):
    run_dir, killed = tmp_path / "frozen_and_served", []
    reward_model = killer("reward_model", run_dir, after_step=1, delay=0.05, killed=killed)
    service = killer("verifier_server", run_dir, after_step=2, delay=0.05, killed=killed, service=verifier,
                     restart_after=1.5)
    assert train(run_dir, args, kill=lambda process: (reward_model(process), service(process))) == 0  # by itself
    assert len(killed) == 2  # both faults happened
    assert sum(r["verifier/retries"] for r in records(run_dir)) > 0  # a scoring found the service down
    assert_the_run_without_the_fault(run_dir, clean)
