"""The whole loop on a real local Ray with real vLLM rollout workers: metrics contract, verified weight sync, and
faults (a worker that never loads the weights, an engine that skips the load, a dropped bucket, a skipped prefix-cache
reset, a worker that hangs), in float32 and bfloat16."""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import ray
import torch

from actors.rollout import RolloutWorker
from bench import step_breakdown
from cluster.config import load_config
from cluster.run.launch import run_training
from learner.config import LearnerConfig
from sync.calls import RunError
from sync.receive import Loaded
from sync.verify import PROBE_NOISE_SEEDS, SyncError
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting workers below travel by value

CONTRACT_KEYS = {"step", "reward/mean", "reward/std", "response_length/mean", "loss/policy", "grad_norm", "kl/mean",
                 "logprob/mismatch", "weights/version", "time/generate", "time/score", "time/reference", "time/train",
                 "time/sync", "time/step", "throughput/tokens_per_s", "verifier/failures"}


def config_for(tmp_path, model_dir, *overrides):
    return load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={model_dir}", "data.prompts_per_step=16",
                              "learner.lr=2e-3", *overrides])


class SkipLoadWorker(RolloutWorker):
    """Claims the new version but never loads the weights: the classic silent stale-weights bug."""

    def load_weights(self, version, *buckets):
        self.weights_version = version
        return Loaded(version)


class EngineSkipsLoadWorker(RolloutWorker):
    """Receives the weights (and fingerprints them) but its engine never applies them: a reload path that does
    nothing. Only the probe can see this one."""

    def load_weights(self, version, *buckets):
        self.engine.load_weights = lambda named, running=False: self.engine.reset_prefix_cache(running)
        return super().load_weights(version, *buckets)


class DropBucketWorker(RolloutWorker):
    """Loads every bucket of the weights but the last: a transport that lost one."""

    def load_weights(self, version, *buckets):
        return super().load_weights(version, *buckets[:-1])


class NoCacheResetWorker(RolloutWorker):
    """Loads the weights but keeps the prefix cache, so cached prompts are scored with the old weights."""

    def load_weights(self, version, *buckets):
        self.engine.reset_prefix_cache = lambda running=False: None
        return super().load_weights(version, *buckets)


class CallLogWorker(RolloutWorker):
    """Logs each call it gets and each load and probe it makes, to the file `log`."""

    log = ""

    def _note(self, line: str) -> None:
        with open(self.log, "a") as out:
            out.write(f"{id(self)} {line}\n")

    def generate(self, prompts, seeds, sampling, *load, **probe):
        self._note(f"generate load={bool(load)} probe={bool(probe)}")
        return super().generate(prompts, seeds, sampling, *load, **probe)

    def load_weights(self, version, *buckets):
        self._note(f"load {version}")
        return super().load_weights(version, *buckets)

    def _probe_sample(self, prompt_ids, completion):  # a probe run alone or as its request's first prompt
        self._note("probe")
        return super()._probe_sample(prompt_ids, completion)


class NoProbeWorker(RolloutWorker):
    """Loads the weights its request carries but never runs the probe it is asked for."""

    def generate(self, prompts, seeds, sampling, *load, **probe):
        return super().generate(prompts, seeds, sampling, *load)


class HangingWorker(RolloutWorker):
    """Generation never returns in time."""

    def generate(self, prompts, seeds, sampling, *load, **probe):
        time.sleep(3600)


def _batch_dependent_head(vllm_worker) -> None:
    """In the engine's worker: the output head's kernel rounds every row one ulp up in batches of a multiple of 3
    rows, as a CPU kernel of another blocking might."""
    head = vllm_worker.model_runner.get_model().lm_head
    kernel = head.cpu_linear

    def uneven(x, weight, bias):
        out = kernel(x, weight, bias)
        return out if (x.numel() // x.shape[-1]) % 3 else torch.nextafter(out, torch.full_like(out, float("inf")))

    head.cpu_linear = uneven


class BatchDependentWorker(RolloutWorker):
    """An engine whose output head's rows depend on the batch, checked again as at its start."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine.llm.collective_rpc(_batch_dependent_head)
        [verdict] = self.engine.llm.collective_rpc("relay_batch_invariance")
        self.engine.batch_invariant, self.engine.invariance = verdict["invariant"], verdict["detail"]


def test_an_engine_whose_rows_depend_on_the_batch_is_reported_at_the_start_and_in_every_record(
        ray_local, tmp_path, demo_model_dir, capsys):
    """The engines' start check reaches the driver: one line naming the worker, the kernel's layers and which
    guarantee drops, and `engine/batch_invariant` 0 in the records (1 where every engine holds: the contract test)."""
    config = config_for(tmp_path, demo_model_dir, "max_steps=2", "rollout.num_workers=1")
    records = run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL,
                           rollout_cls=BatchDependentWorker)
    assert [r["engine/batch_invariant"] for r in records] == [0.0, 0.0]
    err = capsys.readouterr().err
    assert err.count("engine is not batch-invariant here") == 1
    assert "rows depend on the batch in lm_head" in err and "only with rollout.balance=even" in err


def test_loop_learns_and_records_the_contract(ray_local, tmp_path, demo_model_dir):
    config = config_for(tmp_path, demo_model_dir, "max_steps=18", "data.prompts_per_step=32", "learner.lr=5e-5")
    records = run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == records and [r["step"] for r in lines] == list(range(1, 19))
    # The run's start, on the first record only (cluster/run/startup.py): the phases a pooled fleet passes too.
    assert {"time/startup/actors", "time/startup/probe", "time/startup/first_step", "time/startup/total"} \
        <= {k for k in lines[0] if k.startswith(step_breakdown.STARTUP)}
    assert not any(k.startswith(step_breakdown.STARTUP) for record in lines[1:] for k in record)
    for record in lines:
        assert CONTRACT_KEYS <= record.keys()
        # bench/step_breakdown.py lists every phase: none lands in its "overhead" unnoticed.
        assert {k for k in record if k.startswith("time/") and not k.startswith(step_breakdown.STARTUP)} == {
            f"time/{name}" for name in [*step_breakdown.PHASES, *step_breakdown.NESTED, *step_breakdown.IDLE, "step"]}
        assert record["logprob/mismatch"] < 1e-4  # engines sampled with exactly the learner's weights
        assert 0 <= record["mismatch/kl"] < 1e-8
        assert record["sync/probe_max_diff"] < 1e-4
        assert record["rollout/workers"] == 2
        assert record["engine/batch_invariant"] == 1.0  # every engine's start check held
    assert [r["weights/version"] for r in lines] == list(range(1, 19))
    assert all(r["grad_norm"] > 0 for r in lines) and 0.05 < lines[0]["reward/mean"] < 0.5
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (lines[:5], lines[-5:]))
    assert last > first + 0.25, f"the demo did not learn: reward {first:.2f} -> {last:.2f}"
    saved = load_config(tmp_path / "run" / "config.yaml")  # the values; which of them came from the model is not kept
    assert saved.model_dump() == config.model_copy(update={"run_dir": str(tmp_path / "run")}).model_dump()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_worker_loads_and_probes_inside_its_next_request(ray_local, tmp_path, demo_model_dir, dtype):
    """With `object_store` a sync only exports: each worker's next generate request loads the weights and runs the
    probe before it samples (one call per worker per step), and the last step loads and probes at once."""
    log = tmp_path / "calls.log"
    config = config_for(tmp_path, demo_model_dir, "max_steps=3", f"model.dtype={dtype}")
    records = run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL,
                           rollout_cls=type("Logged", (CallLogWorker,), {"log": str(log)}))
    calls: dict[str, list[str]] = {}
    for line in log.read_text().splitlines():
        worker, call = line.split(" ", 1)
        calls.setdefault(worker, []).append(call)
    in_request = ["generate load=True probe=True", "load {}", "probe"]
    assert len(calls) == 2 and all(c == [
        *["probe"] * len(PROBE_NOISE_SEEDS),  # before step 1: the noise floor, on the weights both started from
        "generate load=False probe=False",  # step 1
        *(line.format(1) for line in in_request),  # step 2 loads version 1
        *(line.format(2) for line in in_request),  # step 3 loads version 2
        "load 3", "probe",  # the last step's sync, at once
    ] for c in calls.values()), calls
    assert [r["weights/version"] for r in records] == [1, 2, 3]
    assert all(0 <= r["sync/probe_max_diff"] <= (1e-4 if dtype == "float32" else 0.1) for r in records)
    assert all(r["logprob/mismatch"] < (1e-4 if dtype == "float32" else 0.05) for r in records)


def test_a_request_that_skips_the_probe_stops_the_run(ray_local, tmp_path, demo_model_dir):
    config = config_for(tmp_path, demo_model_dir, "max_steps=2")
    with pytest.raises(SyncError, match=r"weight sync check failed: rollout worker 0 \(version 1\) was asked to run "
                                        r"the probe with its request but returned none"):
        run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL,
                     rollout_cls=NoProbeWorker)


@pytest.mark.parametrize("worker_cls, caught_by", [
    (SkipLoadWorker, r"\(version 1\) reports no fingerprints of the weights it loaded"),
    (EngineSkipsLoadWorker, r"\(version 1\) gives probe logprobs that differ from the learner's"),
    # by the cache hit, or by the logprobs should the stale KV entries ever move them beyond the tolerance
    (NoCacheResetWorker, r"\(version 1\) (gives probe logprobs|took 32 probe prompt tokens from its prefix cache)")])
def test_broken_sync_stops_the_run(ray_local, tmp_path, demo_model_dir, worker_cls, caught_by):
    """float32, caught at the first sync at the default learning rate (whose first, warm-up step is lr/10: the
    smallest change a sync must see): a worker that loads nothing by its missing fingerprints, an engine that skips
    the load by the logprobs (in float32 one step moves them far more than the probe's tolerance), a skipped
    prefix-cache reset by the cache hit itself (its logprob error is as small as the step's change of the weights)."""
    default_lr = LearnerConfig.model_fields["lr"].default
    config = config_for(tmp_path, demo_model_dir, "max_steps=3", f"learner.lr={default_lr}")
    with pytest.raises(SyncError, match="weight sync check failed: rollout worker 0 " + caught_by):
        run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL, rollout_cls=worker_cls)


def test_an_engine_that_skips_the_load_stops_a_bfloat16_run(ray_local, tmp_path, demo_model_dir):
    """bfloat16 at 5e-6, where the engine-learner noise floor (~1e-2) hides a step's change from the probe's gap
    (docs/benchmarks.md, the probe's limits): the engine repeats its probe bit for bit while the learner's logprobs
    of it move beyond the noise, which no engine serving the new weights does."""
    config = config_for(tmp_path, demo_model_dir, "max_steps=6", "model.dtype=bfloat16", "learner.lr=5e-6",
                        "learner.warmup_steps=0")
    with pytest.raises(SyncError, match=r"weight sync check failed: rollout worker 0 \(version \d\) gives bit for bit "
                                        r"the probe logprobs it gave at version 0, while the learner's logprobs"):
        run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL,
                     rollout_cls=EngineSkipsLoadWorker)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dropped_bucket_stops_the_run(ray_local, tmp_path, demo_model_dir, dtype):
    """Through the object store in buckets of 256 KiB: the worker's fingerprints of what reached its engine lack the
    last bucket's tensors, at the first sync and whatever the dtype."""
    config = config_for(tmp_path, demo_model_dir, "max_steps=2", f"model.dtype={dtype}", "sync.shared_memory=false",
                        "sync.bucket_mb=0.25")
    with pytest.raises(SyncError, match=r"weight sync check failed: rollout worker 0 \(version 1\) did not get the "
                                        r"learner's weights: \d+ of the \d+ tensors never reached the engine \(first: "
                                        r"model\.(norm|layers)"):
        run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL,
                     rollout_cls=DropBucketWorker)


def test_a_skipped_prefix_cache_reset_stops_a_bfloat16_run(ray_local, tmp_path, demo_model_dir):
    """bfloat16 at the default learning rate: the logprob gap cannot see one step's change (docs/benchmarks.md, the
    probe's limits), but the first probe after the load must still find nothing of its prompt in the prefix cache."""
    config = config_for(tmp_path, demo_model_dir, "max_steps=3", "model.dtype=bfloat16",
                        f"learner.lr={LearnerConfig.model_fields['lr'].default}")
    with pytest.raises(SyncError, match=r"rollout worker 0 \(version 1\) took 32 probe prompt tokens from its prefix"):
        run_training(config, tmp_path / "run", str(demo_model_dir), display=False, pool=POOL,
                     rollout_cls=NoCacheResetWorker)


def test_without_the_probe_every_deferred_load_is_still_fingerprinted(ray_local, tmp_path, demo_model_dir):
    """`sync.probe=false`: each worker loads the weights at the start of its next request, whose result carries the
    load's fingerprints back: a clean run trains, one that loses a bucket stops at the first step that used it."""
    overrides = ["max_steps=2", "sync.probe=false", "sync.shared_memory=false", "sync.bucket_mb=0.25"]
    records = run_training(config_for(tmp_path / "clean", demo_model_dir, *overrides), tmp_path / "clean" / "run",
                           str(demo_model_dir), display=False, pool=POOL)
    assert [r["weights/version"] for r in records] == [1, 2] and math.isnan(records[-1]["sync/probe_max_diff"])
    assert all(r["logprob/mismatch"] < 1e-4 for r in records)
    with pytest.raises(SyncError, match=r"weight sync check failed: rollout worker \d \(version 1\) did not get the "
                                        r"learner's weights: \d+ of the \d+ tensors never reached the engine"):
        run_training(config_for(tmp_path / "drop", demo_model_dir, *overrides), tmp_path / "drop" / "run",
                     str(demo_model_dir), display=False, pool=POOL, rollout_cls=DropBucketWorker)


def test_worker_that_keeps_hanging_is_replaced_until_the_bound_then_stops_the_run(ray_local, tmp_path, tiny_model_dir):
    config = config_for(tmp_path, tiny_model_dir, "max_steps=1", "timeouts.generate=2", "rollout.num_workers=1",
                        "rollout.max_restarts=1")
    started = time.monotonic()
    with pytest.raises(RunError, match=r"rollout worker 0 missed the 2 s deadline of 'generate', and 1 rollout "
                                       r"workers were already replaced \(rollout.max_restarts=1\)"):
        run_training(config, tmp_path / "run", str(tiny_model_dir), display=False, pool=POOL, rollout_cls=HangingWorker)
    assert time.monotonic() - started < 120
    assert POOL.parked is not None and POOL.parked.rollout == []  # the worker stuck in its call was not kept
