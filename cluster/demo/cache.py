"""Where the demo's base models live and how a machine gets them: `$RELAY_CACHE_DIR` (else `~/.cache/relay`), filled
atomically with relay's shipped copy or, failing that, a build from the task's recipe.

Owns the models' cache and shipped directories and `ensure_demo_model`. Does not own their names or how a directory
appears whole (`cluster.demo.catalog`, which the build shares), nor building them (`cluster.demo.model`, imported
only when a build is needed): a run whose model is cached or shipped imports neither torch nor transformers from
here, so `relay train` on the demo starts without them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from cluster.demo.catalog import DEMO_TEACHER_NAME, MODEL_NAMES, atomic_dir, demo_task

SHIPPED_MODELS_DIR = Path(__file__).parent / "models"  # relay's own builds: `shipped_demo_model`


def demo_model_dir(task: str = "arithmetic") -> Path:
    """`$RELAY_CACHE_DIR/<name>`, or `~/.cache/relay/<name>` when the variable is unset; the name is
    `demo-model-v1` for arithmetic (and a dataset), `demo-chain-model-v1` for chain_sum, `demo-calc-model-v1` for
    calc."""
    cache_dir = os.environ.get("RELAY_CACHE_DIR")
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "relay"
    return root / MODEL_NAMES[demo_task(task)]


def shipped_demo_model(task: str = "arithmetic") -> Path:
    """The copy of `task`'s demo model that relay ships (`cluster/demo/models/<name>`): built by
    `build_demo_model` with the task's recipe and seed 0, so that a fresh machine starts from the same weights as
    the numbers in the docs and needs no build (the build's float rounding differs between CPUs)."""
    return SHIPPED_MODELS_DIR / MODEL_NAMES[demo_task(task)]


def demo_teacher_dir() -> Path:
    """The demo teacher relay ships (`teacher.path=demo`): the arithmetic demo model after `configs/grpo.yaml`'s run,
    made by `python -m cluster.demo.teacher`. Read where it lies: the teacher is only read, never rebuilt."""
    return SHIPPED_MODELS_DIR / DEMO_TEACHER_NAME


def ensure_demo_model(log: Callable[[str], object] = print, task: str = "arithmetic", build: bool = False) -> Path:
    """Returns the directory of `task`'s demo model (`demo_model_dir(task)`), filling it first if missing: with a
    copy of the shipped model (`shipped_demo_model`), or, with `build` (or nothing shipped), by building it from its
    recipe (its build time: docs/benchmarks.md). `task` is a `data.task`: "dataset" gets the arithmetic model."""
    task = demo_task(task)
    path = demo_model_dir(task)
    if path.exists():  # complete if present: atomic_dir renames a finished directory into place
        return path
    what = {"arithmetic": "demo model", "chain_sum": "chain_sum demo model", "calc": "calc demo model"}[task]
    shipped = shipped_demo_model(task)
    try:
        if not build and (shipped / "model.safetensors").exists():
            with atomic_dir(path) as tmp_dir:
                shutil.copytree(shipped, tmp_dir)
            log(f"Copied relay's shipped {what} to {path}")
            return path
        from cluster.demo.model import build_demo_model

        how_long = "under 2 minutes" if task == "chain_sum" else "under a minute"
        log(f"Building the {what} in {path} (once; {how_long} on 2 idle cores)...")
        report = build_demo_model(path, task=task)
    except FileExistsError:
        if not path.exists():
            raise
        log(f"Another process made the {what} in {path} first; using it")
        return path
    log(
        f"Built the {what} in {report['seconds']:.0f} s after {report['steps']} steps: held-out accuracy "
        f"greedy {report['greedy_accuracy']:.2f}, sampled at T=1 {report['sampled_accuracy']:.2f}"
        + (f" (tool used on {report['sampled_tool_use_rate']:.2f} of first turns)" if task == "calc" else "")
    )
    return path
