"""What the demo models' build (cluster/demo/model.py) and their cache (cluster/demo/cache.py) share: the tasks with
a built-in model, each model's name (its directory's, cached and shipped), and `atomic_dir`, how a model directory
appears whole.

Here, below both, so that the build does not import the cache, which imports the build (only when a model must be
built). Imports only the standard library.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEMO_MODEL_NAME = "demo-model-v1"  # bump the suffix whenever the recipe changes the built weights (cluster.demo.model)
CHAIN_MODEL_NAME = "demo-chain-model-v1"  # likewise for `CHAIN_RECIPE`
CALC_MODEL_NAME = "demo-calc-model-v1"  # likewise for `CALC_RECIPE`
# The arithmetic demo model after a GRPO run, on-policy distillation's demo teacher (`cluster.demo.teacher`): bump the
# suffix when it is made anew
DEMO_TEACHER_NAME = "demo-teacher-v1"
DEMO_TASKS = ("arithmetic", "chain_sum", "calc")  # the tasks with a built-in model; "dataset" gets the arithmetic one
MODEL_NAMES = {"arithmetic": DEMO_MODEL_NAME, "chain_sum": CHAIN_MODEL_NAME, "calc": CALC_MODEL_NAME}


def demo_task(task: str) -> str:
    """The built-in task whose model serves `task` (a `data.task`): itself, or arithmetic for a user's dataset or
    reasoning-gym's tasks."""
    if task in ("dataset", "reasoning_gym"):  # without model.path they have always run on the arithmetic model
        return "arithmetic"  # (char tokenizer: cluster/run/data.py refuses the prompts it cannot hold)
    if task not in DEMO_TASKS:
        raise ValueError(f"no demo model for task {task!r}; use one of {', '.join(DEMO_TASKS)} or set model.path")
    return task


@contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yields a temporary sibling of `out_dir` to fill, renamed to `out_dir` when the block ends (removed if it
    raises), so a reader sees either no directory or a complete one. Raises FileExistsError if `out_dir` exists
    before or appears meanwhile (another process renamed its complete copy first)."""
    if out_dir.exists():
        raise FileExistsError(f"model dir {out_dir} already exists: delete it or choose another path")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        yield tmp_dir
        try:
            os.rename(tmp_dir, out_dir)
        except OSError as error:  # ENOTEMPTY/EEXIST
            if out_dir.exists():
                raise FileExistsError(f"model dir {out_dir} was created by another process meanwhile") from error
            raise
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
