"""What the run tests share: the part of a step's record that training decides (tests/cluster/test_evaluation.py's
evaluated-vs-plain check too), and the check that a run resumed from a checkpoint repeats the original bit for bit
(tests/cluster/test_lora.py, tests/cluster/test_distill.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

NOT_TRAINING = ("time/", "eval/", "throughput/", "memory/")


def training_part(record: dict) -> dict:
    """What the run trained on and computed, not how long it took, what memory it held or what it evaluated.
    `sync/probe_max_diff` is the check of whichever request loaded the weights first, an evaluation's too, so it may
    move to another step."""
    return {k: v for k, v in record.items() if not k.startswith(NOT_TRAINING) and k != "sync/probe_max_diff"}


def assert_resume_repeats(preset: Path, run_dir: Path, overrides: list[str], records: list[dict]) -> Path:
    """A copy of the 4-step run in `run_dir` (checkpoints at 2 and 4, `records` its records), its step-4 checkpoint
    removed, resumed (`resume=auto`: from step 2) on the session's pool: it must repeat steps 3 and 4 bit for bit.
    Returns the resumed run's directory."""
    resumed = run_dir.parent / f"{run_dir.name}-resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    again = run_training(load_config(preset, [f"run_dir={resumed}", "resume=auto", *overrides]), resumed,
                         display=False, pool=POOL)
    assert [r["step"] for r in again] == [3, 4]
    assert [training_part(r) for r in again] == [training_part(r) for r in records[2:]]
    return resumed
