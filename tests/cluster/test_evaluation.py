"""Evaluation during training and `relay eval`, on a real local Ray with real vLLM engines, in float32 (on-policy) and
bfloat16 (asynchronous, where it overlaps the next update): a run that evaluates trains bit for bit like one that does
not, every evaluated step is in the records with its own weights, and a checkpoint evaluated afterwards gives the
numbers the run logged at its step. A run stopped (Ctrl-C) while a step's evaluation overlaps the next update still
records that step, its evaluation included."""

from __future__ import annotations

import hashlib
import signal

import pytest

from cluster.config import load_config
from cluster.run.launch import RunInterrupted, run_evaluation, run_training
from cluster.run.metrics import MetricsRecorder, read_records
from tests.fleets import POOL
from tests.resume import training_part

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

MODES = {  # dtype -> the run's regime, and where it evaluates (checkpoints at 2 and 4, or at 4 only)
    "float32": ["checkpoint.every=2", "eval.every=2"],
    "bfloat16": ["rollout.max_staleness=1", "checkpoint.every=4", "eval.every=1"],
}


def weights_digest(run_dir) -> str:
    weights = run_dir / "checkpoints" / "step_4" / "policy" / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_evaluation_changes_nothing_the_run_trains_and_relay_eval_repeats_it(ray_local, tmp_path, demo_model_dir,
                                                                              dtype):
    common = [f"model.path={demo_model_dir}", f"model.dtype={dtype}", "max_steps=4", "data.prompts_per_step=16",
              "learner.lr=2e-3", "data.held_out=0.1", *MODES[dtype]]
    evaluated = [*common, "eval.max_prompts=12", "eval.num_samples=4", "eval.temperature=1.0"]
    runs = {}
    for name, overrides in [("plain", [o for o in common if not o.startswith("eval.")]), ("evaluated", evaluated)]:
        config = load_config(None, [f"run_dir={tmp_path / name}", *overrides])
        runs[name] = run_training(config, tmp_path / name, display=False, pool=POOL)

    plain, records = runs["plain"], runs["evaluated"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for evaluated_record, plain_record in zip(records, plain):  # bit for bit; a failure names the keys that differ
        ours, theirs = training_part(evaluated_record), training_part(plain_record)
        differ = {k: (ours.get(k), theirs.get(k)) for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
        assert not differ, f"step {ours['step']}: (evaluated, plain) differ in {differ}"
    assert weights_digest(tmp_path / "plain") == weights_digest(tmp_path / "evaluated")
    every = int(MODES[dtype][-1].split("=")[1])
    evaluated_steps = [r["step"] for r in records if "eval/step" in r]
    assert evaluated_steps == [s for s in range(1, 5) if s % every == 0]
    for record in records:
        if "eval/step" in record:
            assert record["eval/step"] == record["step"]  # its own weights, also when it overlapped the next update
            assert record["eval/prompts"] == 12 and record["eval/dropped_groups"] == 0
            assert 0 <= record["eval/pass@1"] <= record["eval/pass@2"] <= record["eval/pass@4"] <= 1
            assert record["eval/reward/mean"] == record["eval/reward/correct"] == record["eval/mean@4"]
            assert record["time/eval"] > 0
    assert not any(k.startswith("eval/") for r in plain for k in r)
    # Different weights, different evaluations (the same prompts and seeds each time).
    assert len({r["eval/reward/mean"] for r in records if "eval/step" in r}) > 1 or every == 2

    checkpoint = tmp_path / "evaluated" / "checkpoints" / "step_4"
    config = load_config(checkpoint / "config.yaml", [])
    metrics = run_evaluation(config, tmp_path / "eval", checkpoint, pool=POOL)
    logged = {k: v for k, v in records[-1].items() if k.startswith("eval/")}
    assert {k: v for k, v in metrics.items() if k.startswith("eval/")} == logged  # the run's numbers, exactly
    assert (tmp_path / "eval" / "eval.json").is_file()


def test_a_run_stopped_while_a_steps_evaluation_overlaps_the_next_update_records_that_step(
        ray_local, tmp_path, demo_model_dir, monkeypatch):
    # Asynchronous, evaluating every step: step t's record waits for its evaluation, which step t + 1 collects. Ctrl-C
    # during step 2 (when step 1's record is written) stops the run after step 2, whose record is then held.
    write = MetricsRecorder.write

    def write_then_interrupt(recorder, record):
        write(recorder, record)
        if record["step"] == 1:
            signal.raise_signal(signal.SIGINT)  # what a first Ctrl-C does: stop before the next step

    monkeypatch.setattr(MetricsRecorder, "write", write_then_interrupt)
    run_dir = tmp_path / "stopped"
    config = load_config(None, [f"run_dir={run_dir}", f"model.path={demo_model_dir}", "max_steps=4",
                                "data.prompts_per_step=8", "data.held_out=0.1", "rollout.max_staleness=1",
                                "eval.every=1", "eval.max_prompts=4"])
    with pytest.raises(RunInterrupted, match="after step 2"):
        run_training(config, run_dir, display=False, pool=POOL)
    records = read_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]  # step 2 trained: its record is not lost with the stop
    assert [r.get("eval/step") for r in records] == [1, 2] and records[1]["eval/prompts"] == 4
