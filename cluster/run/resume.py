"""Resuming a run: which checkpoint, and whether the resumed run's config can honour it.

Owns: resolving `resume=auto|PATH` to a complete checkpoint (or to "start fresh" for `auto` in a run without one),
the run directory a `resume=PATH` without `run_dir` continues (`run_dir_for`), and refusing a config that changes
what the run computes (one line naming the keys): which keys are free to change (`MAY_CHANGE`), which only move the
run to other hardware (`PLACEMENT`), which are free unless the checkpoint's config makes them matter
(`CONDITIONAL`). Does not own: writing checkpoints (cluster/run/checkpoint.py, the learner), restoring state
(cluster/run/trainer.py), or trimming the metrics back to the checkpoint (cluster/run/metrics.py).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ConfigError, RunConfig
from cluster.run import checkpoint

# What a resumed run may change (docs/operations.md, "What a resumed run may change"); every other difference from the
# checkpoint's config is refused, naming the key.
# Free: no number the run computes depends on them (where and how fast it runs, deadlines, when it gives up, logging,
# addresses, credentials, the sync's transport and checks). `max_steps`: the steps both runs have are the same.
# `eval.*`: an evaluation changes nothing the run trains on (tests/cluster/test_evaluation.py), only its own metrics.
MAY_CHANGE = [
    "max_steps", "resume", "run_dir", "timeouts.*", "ray.*", "logging.*", "checkpoint.keep", "sync.*", "eval.*",
    "rollout.num_cpus", "rollout.max_restarts", "rollout.resources*", "rollout.node_labels*", "rollout.placement",
    "learner.num_cpus", "learner.resources*", "learner.max_nonfinite_steps", "reference.num_cpus",
    "reference.resources*", "reward.sources.*.urls", "reward.sources.*.timeout", "reward.sources.*.max_retries",
    "reward.sources.*.backoff", "reward.sources.*.backoff_max", "reward.sources.*.max_concurrency",
    "reward.sources.*.batch_size", "reward.sources.*.token_env", "reward.sources.*.verify_tls",
    "reward.sources.*.num_cpus",
]
# Placement: which hardware runs each part and how much of it. A resume must be able to change them (another machine,
# a lost node, scaling, as `relay scale` does mid-run); like another machine, they sum floats in another order, so
# the resumed run differs from the uninterrupted one in the last bits the docs name, and from there on.
PLACEMENT = [
    "rollout.num_workers", "rollout.balance", "rollout.tensor_parallel_size", "rollout.num_gpus",
    "rollout.num_threads", "rollout.kv_cache_bytes", "rollout.gpu_memory_utilization", "learner.num_ranks",
    "learner.strategy", "learner.num_gpus", "learner.num_threads", "reference.num_gpus", "reference.num_threads",
    "reward.sources.*.num_gpus", "reward.sources.*.num_threads",
]
# Why a refused key that reads like a speed setting changes the run (said in the error): on the same hardware, the
# same numbers come out another way.
_REFUSED_WHY = {
    "*.micro_batch_size": "sums floats in other micro-batches",
    "*.max_tokens_per_micro_batch": "sums floats in other micro-batches",
    "*.share_prompts": "sums floats in another order",
    "*.pack_sequences": "sums floats in another order",
    "rollout.enforce_eager": "samples with other kernels",
    "rollout.cpu_linear": "samples with other kernels",
}


def _checkpoint_every(saved: dict[str, Any]) -> str | None:
    """With `rollout.max_staleness` k >= 1 the pipeline drains at checkpoint steps, and the drains fix which weights
    version samples each batch (max(c, t - 1 - k)); on-policy they only write checkpoints."""
    k = saved.get("rollout.max_staleness") or 0
    return f"changes which weights sample each batch with rollout.max_staleness={k}" if k else None


# Free unless the checkpoint's config makes them change the run: key -> why then (None: free).
CONDITIONAL = {"checkpoint.every": _checkpoint_every}


@dataclass(frozen=True)
class ResumePoint:
    """A complete checkpoint to continue from."""

    path: Path
    step: int
    state: dict[str, Any]  # driver_state.json: step, weights_version, data cursor


def find(config: RunConfig, run_dir: Path) -> ResumePoint | None:
    """The checkpoint `config.resume` names, validated; None for a fresh start. Raises ConfigError (one line)."""
    if not config.resume:
        return None
    if config.resume == "auto":
        path = checkpoint.latest(run_dir)
        if path is None:
            return None  # nothing to resume yet: `resume=auto` starts the run
    else:
        path = Path(config.resume)
    try:
        state = checkpoint.read_driver_state(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"resume={config.resume}: {str(err).splitlines()[0]}") from None
    point = ResumePoint(path, int(state["step"]), state)
    conflicts = _conflicts(yaml.safe_load((path / checkpoint.CONFIG_FILE).read_text()), config)
    if conflicts:
        shown = "; ".join(conflicts[:3]) + (f"; and {len(conflicts) - 3} more" if len(conflicts) > 3 else "")
        raise ConfigError(f"cannot resume from {path}: the config changed what the run computes ({shown}); use the "
                          "checkpoint's values or start a new run_dir")
    return point


def run_dir_for(config: RunConfig) -> Path | None:
    """`resume=PATH` without `run_dir` continues the run that holds PATH (run_dir/checkpoints/step_N)."""
    if config.resume and config.resume != "auto" and not config.run_dir:
        return Path(config.resume).resolve().parent.parent
    return None


def _conflicts(saved: dict[str, Any], config: RunConfig) -> list[str]:
    """One line per changed key the resumed run may not change: `key: old -> new`, and why where it is not plain."""
    old, new = _flat(saved), _flat(config.model_dump(mode="json"))
    conflicts = []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) == new.get(key) or _matches(key, MAY_CHANGE + PLACEMENT):
            continue
        if key in CONDITIONAL:
            why = CONDITIONAL[key](old)
            if why is None:
                continue
        else:
            why = next((reason for pattern, reason in _REFUSED_WHY.items() if fnmatch.fnmatchcase(key, pattern)), "")
        change = f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}"
        conflicts.append(f"{change} {why}" if why else change)
    return conflicts


def _matches(key: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
