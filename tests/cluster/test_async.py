"""Asynchronous training (`rollout.max_staleness` >= 1) through the real loop, real Ray and real vLLM engines: each
batch is sampled with exactly the weights version the rule names (the pipeline drains at checkpoint steps), the
engines' logprobs show it (they match the learner's only where the batch is fresh), two runs give the same metrics
and bitwise the same weights in float32 and bfloat16, a worker killed with requests queued behind the one it dies
in is replaced, its requests run again with the same seeds and versions, and a worker removed by `relay scale` with
a request queued hands it on: neither changes the run (in either dtype). In-flight updates land mid-request within
the staleness bound."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time

import pytest
import ray
from safetensors.torch import load_file

from actors.rollout import RolloutWorker
from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting worker travels by value

STEPS = 5
# checkpoint.every=3: the pipeline drains at step 3 (and 5, the last). k = 1: B1, B2 with v0 (the start), B3 with
# v1, B4 and B5 with v3 (after the drain).
VERSIONS = [0, 0, 1, 3, 3]
STALENESS = [0, 1, 1, 0, 1]  # versions behind the learner's when it trained on the batch
VOLATILE = ("time/", "throughput/", "memory/")


def run(tmp_path, model_dir, name, dtype="float32", rollout_cls=None, *overrides, steps=STEPS, pool=POOL):
    config = load_config(None, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", f"max_steps={steps}",
                                "data.prompts_per_step=8", "rollout.num_workers=2", "learner.lr=2e-3",
                                "rollout.max_staleness=1", "checkpoint.every=3", f"model.dtype={dtype}", *overrides])
    records = run_training(config, tmp_path / name, str(model_dir), display=False, pool=pool, rollout_cls=rollout_cls)
    weights = load_file(tmp_path / name / "checkpoints" / f"step_{steps}" / "policy" / "model.safetensors")
    return records, weights


def stable(records):
    """What two runs must agree on (NaN as None: NaN != NaN)."""
    return [{k: None if v != v else v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def differences(ours, theirs, drop=()):
    """(step, key, ours, theirs) wherever two runs' stable records differ, leaving out the keys `drop`."""
    ours, theirs = stable(ours), stable(theirs)
    assert len(ours) == len(theirs)
    return [(a["step"], k, a.get(k), b.get(k)) for a, b in zip(ours, theirs)
            for k in sorted(set(a) | set(b)) if k not in drop and a.get(k) != b.get(k)]


@pytest.fixture(scope="module")
def first_run(ray_local, tmp_path_factory, demo_model_dir):
    return {dtype: run(tmp_path_factory.mktemp(dtype), demo_model_dir, "first", dtype)
            for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_batch_is_sampled_with_exactly_the_version_the_rule_names(first_run, dtype):
    records, _ = first_run[dtype]
    assert [r["rollout/version"] for r in records] == VERSIONS
    assert [r["async/staleness"] for r in records] == STALENESS
    assert [r["weights/version"] for r in records] == [1, 2, 3, 4, 5]
    # The engines' logprobs are the sampling version's: equal to the learner's (the proximal policy) only for fresh
    # batches; a batch one update old differs by that update (lr 2e-3 moves them by ~1e-2).
    fresh_floor, stale_floor = (1e-4, 1e-3) if dtype == "float32" else (2e-2, 2e-2)
    for r, staleness in zip(records, STALENESS):
        assert (r["logprob/mismatch"] < fresh_floor) if staleness == 0 else (r["logprob/mismatch"] > stale_floor), r
        assert "rollout_correction/weight_mean" in r  # decoupled PPO: tis by default with max_staleness >= 1
        assert r["time/learner_wait"] >= 0 and r["time/rollout_idle"] >= 0
    # Probes are checked when their batch is collected (NaN: none in that step, e.g. a drain step collects nothing).
    gaps = [r["sync/probe_max_diff"] for r in records]
    tolerance = 1e-4 if dtype == "float32" else 0.1
    assert sum(gap == gap for gap in gaps) >= 4 and not any(gap >= tolerance for gap in gaps)
    # That a second run repeats this one, metric for metric and bit for bit, the killed-worker and removed-worker
    # tests below show in both dtypes (their runs equal this one despite the fault).


class KilledWithQueueWorker(RolloutWorker):
    """Dies (SIGKILL, as an OOM kill) in its 2nd generate call (step 2's batch), once in the run (a marker file),
    after waiting long enough for step 3's batch to be queued behind it (sent right after step 1's update)."""

    marker = ""

    def generate(self, prompts, seeds, sampling, *load, **probe):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                time.sleep(3)
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        return super().generate(prompts, seeds, sampling, *load, **probe)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_worker_killed_with_requests_queued_is_replaced_and_the_run_is_unchanged(first_run, tmp_path,
                                                                                  demo_model_dir, dtype):
    worker_cls = type("Killed", (KilledWithQueueWorker,), {"marker": str(tmp_path / "killed.marker")})
    records, weights = run(tmp_path, demo_model_dir, "killed", dtype, worker_cls)
    assert (tmp_path / "killed.marker").exists()  # the fault happened
    assert records[-1]["rollout/restarts"] == 1
    clean, clean_weights = first_run[dtype]
    assert [r["rollout/version"] for r in records] == VERSIONS
    assert differences(records, clean, drop=("rollout/restarts",)) == []
    assert all((weights[name] == clean_weights[name]).all() for name in weights)
    metrics = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["time/recovery"] > 0 for r in metrics) == 1


# Updates of several seconds, longer than the deadlines below also on the fastest CI CPU (60 epochs did not outlast
# `timeouts.generate` on the AVX-512 EPYC, which tested nothing).
SLOW_UPDATES = ["learner.ppo_epochs=100", "learner.num_minibatches=4"]


def test_updates_longer_than_the_deadlines_cost_no_healthy_worker_and_a_death_during_one_is_the_workers(
        ray_local, tmp_path, demo_model_dir):
    """Updates slower than `timeouts.generate` and `timeouts.sync`: a request's generate deadline counts from when the
    weights it loads were exported (after the update), so no healthy worker is declared late; a worker killed while
    the learner trains is replaced and its requests run again, without waiting for the update or blaming the
    learner (its export, queued behind the update, is not waited for). Deadlines and who is blamed are clocks and
    queues, the same in every dtype: float32 only (the replacement's exact bits in bfloat16 are the killed-worker
    tests' business). Three steps: the worker dies in step 2's batch while step 1's update runs, and step 3's batch
    is sampled with the version that update made (the drain at step 3 is the run's end)."""
    worker_cls = type("Killed", (KilledWithQueueWorker,), {"marker": str(tmp_path / "killed.marker")})
    records, _ = run(tmp_path, demo_model_dir, "slow", "float32", worker_cls, *SLOW_UPDATES, "timeouts.generate=4",
                     "timeouts.sync=3", steps=3)
    assert (tmp_path / "killed.marker").exists()  # the fault happened
    assert max(r["time/train"] for r in records) > 4, "the updates did not outlast the deadlines: nothing was tested"
    assert records[-1]["rollout/restarts"] == 1  # the killed worker only
    assert [r["rollout/version"] for r in records] == VERSIONS[:3]


class ProbeLogWorker(RolloutWorker):
    """Logs each probe whose gap the driver checks: sampled by the engine ("probe") or by the learner and scored by the
    engine ("score_probe")."""

    log = ""

    def _probe_sample(self, prompt_ids, completion):
        with open(self.log, "a") as out:
            out.write("probe\n")
        return super()._probe_sample(prompt_ids, completion)

    def score_probe(self, *args, **kwargs):
        with open(self.log, "a") as out:
            out.write("score_probe\n")
        return super().score_probe(*args, **kwargs)


def test_every_probe_of_an_asynchronous_run_is_compared_at_one_temperature(ray_local, tmp_path, demo_model_dir):
    """The noise floor the tolerance comes from is measured with the probes the steps check: the learner's sample,
    scored by the engines at temperature 1 (not an engine's sample at the sampling temperature)."""
    log = tmp_path / "probes.log"
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={demo_model_dir}", "max_steps=3",
                                "data.prompts_per_step=8", "rollout.num_workers=2", "rollout.max_staleness=1",
                                "rollout.temperature=0.7"])
    records = run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL,
                           rollout_cls=type("Logged", (ProbeLogWorker,), {"log": str(log)}))
    kinds = log.read_text().split()
    assert kinds[:2] == ["score_probe"] * 2  # the noise floor, one per worker, before step 1
    assert set(kinds) == {"score_probe"}, kinds  # and every load's probe, and the last step's
    assert all(r["sync/probe_max_diff"] < 1e-4 for r in records if r["sync/probe_max_diff"] == r["sync/probe_max_diff"])


class PacedWorker(RolloutWorker):
    """Each request takes at least 2 s (marker files tell the test when the first one started), so that a
    `relay scale` request lands while the next batch is queued."""

    markers = ""

    def generate(self, prompts, seeds, sampling, *load, **probe):
        open(self.markers, "a").close()
        time.sleep(2)
        return super().generate(prompts, seeds, sampling, *load, **probe)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_worker_removed_with_requests_queued_hands_them_on_and_the_run_is_unchanged(first_run, tmp_path,
                                                                                     demo_model_dir, dtype):
    """`relay scale` removes worker 0 at step 2's boundary, when step 3's batch is already queued on it: its request
    goes to worker 1, and a new worker joins once its engine is up. Completions depend on the prompt's seed and the
    batch's version only, so the run is the clean one, metric for metric and weight for weight."""
    from cluster.fleet.control import find_run, run_name

    run_dir, started = tmp_path / "scaled", tmp_path / "started"
    worker_cls = type("Paced", (PacedWorker,), {"markers": str(started)})
    seen: dict = {}

    def operator() -> None:
        try:
            while not started.exists():  # step 1's batches are out: the request is taken at step 2's start
                time.sleep(0.05)
            seen["reply"] = ray.get(find_run(run_name(str(run_dir))).request_scale(2, [0]), timeout=30)
        except Exception as err:  # reported by the assertions below
            seen["error"] = repr(err)

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    records, weights = run(tmp_path, demo_model_dir, "scaled", dtype, worker_cls)
    thread.join(timeout=60)
    assert "error" not in seen and seen["reply"]["remove"] == [0], seen
    assert records[0]["rollout/workers"] == 2 and records[1]["rollout/workers"] == 1  # removed at step 2's start
    assert records[-1]["rollout/scale_events"] >= 1
    fleet = ("rollout/workers", "rollout/workers_pending", "rollout/scale_events")
    clean, clean_weights = first_run[dtype]
    # A worker that joins is probed on admission: one more probe in its step's largest gap (sync/probe_max_diff).
    joined = {r["step"] for before, r in zip(records, records[1:]) if r["rollout/workers"] > before["rollout/workers"]}
    found = [(step, key, *values) for step, key, *values in differences(records, clean, drop=fleet)
             if not (step in joined and key == "sync/probe_max_diff")]
    assert found == [], [r["rollout/workers"] for r in records]
    assert all((weights[name] == clean_weights[name]).all() for name in weights)


def test_dynamic_sampling_samples_a_steps_extra_rounds_with_its_own_version(ray_local, tmp_path, demo_model_dir):
    records, _ = run(tmp_path, demo_model_dir, "dapo", "float32", None, "rollout.dynamic_sampling=true",
                     "rollout.max_sampling_rounds=3")
    assert [r["rollout/version"] for r in records] == VERSIONS
    assert any(r["sampling/rounds"] > 1 for r in records)  # some step needed another round
    assert all(r["sampling/kept_groups"] + r["sampling/filler_groups"] == 8 for r in records)
    for r, staleness in zip(records, STALENESS):  # every round of a fresh batch: the learner's own weights
        assert (r["logprob/mismatch"] < 1e-4) if staleness == 0 else (r["logprob/mismatch"] > 1e-3), r


class SlowStepsWorker(RolloutWorker):
    """A slow engine, or long generations: each engine step takes 40 ms more, and a request's second step waits (up
    to `WAIT` s) for the learner's next version to be offered, so new weights land mid-request however fast the
    learner is against the engine (bfloat16 on an AVX2 CPU: its step outlasted a whole request)."""

    WAIT = 3.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        stepwise = self.engine.generate_stepwise

        def slow(*args, **kwargs):
            *head, before_step = args
            steps = itertools.count()

            def slowed() -> int:
                time.sleep(0.04)
                if next(steps) == 1:
                    deadline = time.monotonic() + self.WAIT
                    while self._newest_offer() is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                return before_step()
            return stepwise(*head, slowed, **kwargs)
        self.engine.generate_stepwise = slow


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_in_flight_updates_give_fresher_tokens_within_the_bound(ray_local, tmp_path, demo_model_dir, dtype):
    """`rollout.in_flight_updates`: engines take each new version between two steps of the request they run; batches
    still start from the version the rule names, later tokens come from newer versions (never newer than the
    learner's), every load is fingerprint-checked and the last one of a request probed (the run would stop). Replayed
    groups (older versions) are mixed in: token staleness counts the step's fresh rollouts only."""
    records, _ = run(tmp_path, demo_model_dir, "in_flight", dtype, SlowStepsWorker, "rollout.in_flight_updates=true",
                     "data.replay_fraction=0.25")
    assert any(r["replay/staleness"] > s for r, s in zip(records, STALENESS))  # replay alone would exceed the bound
    assert [r["rollout/version"] for r in records] == VERSIONS
    assert [r["async/staleness"] for r in records] == STALENESS
    assert [r["weights/version"] for r in records] == [1, 2, 3, 4, 5]
    tokens = [r["async/token_staleness"] for r in records]
    assert all(0 <= t <= s for t, s in zip(tokens, STALENESS)), tokens
    assert sum(r["rollout/in_flight_loads"] for r in records) >= 1
    assert any(t < s for t, s in zip(tokens, STALENESS)), tokens  # some tokens of a stale batch came fresher
    gaps = [r["sync/probe_max_diff"] for r in records]
    assert not any(gap >= (1e-4 if dtype == "float32" else 0.1) for gap in gaps if gap == gap), gaps


def test_a_data_parallel_learner_exports_and_probes_every_version(ray_local, tmp_path, demo_model_dir):
    """fsdp2 over two ranks through the driver: placement reserves a bundle per rank, every rank runs the update and
    draws the same probe sample (HF generate on the sharded model), rank 0 exports and writes the checkpoints (the
    final one's weights are loaded below); the pipeline is the one-rank pipeline. The run has a fleet of its own
    (`pool=None`), beside the session's parked fleet (a quarter CPU per rank and worker, so that both fit), which the
    next module then still finds. One rollout worker: the version rule is the fleet's, whatever its size, and each
    engine of a fresh fleet is a process to start."""
    records, _ = run(tmp_path, demo_model_dir, "fsdp2", "float32", None, "learner.num_ranks=2",
                     "learner.strategy=fsdp2", "learner.num_threads=1", "learner.num_cpus=0.25",
                     "rollout.num_cpus=0.25", "rollout.num_workers=1", pool=None)
    assert [r["rollout/version"] for r in records] == VERSIONS
    gaps = [r["sync/probe_max_diff"] for r in records]
    assert sum(gap == gap for gap in gaps) >= 4 and not any(gap >= 1e-4 for gap in gaps)
    for r, staleness in zip(records, STALENESS):
        assert (r["logprob/mismatch"] < 1e-4) if staleness == 0 else (r["logprob/mismatch"] > 1e-3), r
