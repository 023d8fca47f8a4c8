"""Resuming a run: which checkpoint, and whether the resumed run's config can honour it.

Owns: resolving `resume=auto|PATH` to a complete checkpoint (or to "start fresh" for `auto` in a run without one),
the run directory a `resume=PATH` without `run_dir` continues (`run_dir_for`), and refusing a config that changed
anything the checkpoint's state depends on (with a one-line message naming the keys). Does not own: writing
checkpoints (cluster/run/checkpoint.py, the learner), restoring state (cluster/run/driver.py), or trimming the
metrics back to the checkpoint (cluster/run/metrics.py).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ConfigError, RunConfig
from cluster.run import checkpoint

# Keys a resumed run may change: where and how fast it runs, not what it computes. Everything else must equal the
# checkpoint's config, or the resumed run would not continue the same run.
MAY_CHANGE = [
    "max_steps", "resume", "run_dir", "timeouts.*", "ray.*", "logging.*", "checkpoint.*", "sync.*",
    "rollout.num_workers", "rollout.num_cpus", "rollout.num_gpus", "rollout.num_threads", "rollout.max_restarts",
    "rollout.kv_cache_bytes", "rollout.gpu_memory_utilization", "rollout.enforce_eager",
    "rollout.resources*", "rollout.node_labels*", "rollout.placement", "rollout.balance",
    "rollout.tensor_parallel_size", "learner.resources*", "reference.resources*", "learner.num_ranks",
    "learner.strategy",
    "reference.num_cpus", "reference.num_gpus", "reference.num_threads", "reference.micro_batch_size",
    "reference.max_tokens_per_micro_batch", "reference.share_prompts", "learner.num_cpus", "learner.num_gpus",
    "learner.num_threads", "learner.micro_batch_size", "learner.max_tokens_per_micro_batch", "learner.share_prompts",
    "learner.max_nonfinite_steps",
    "reward.sources.*.urls", "reward.sources.*.timeout", "reward.sources.*.max_retries", "reward.sources.*.backoff",
    "reward.sources.*.backoff_max", "reward.sources.*.max_concurrency", "reward.sources.*.batch_size",
    "reward.sources.*.token_env", "reward.sources.*.verify_tls", "reward.sources.*.num_cpus",
    "reward.sources.*.num_gpus", "reward.sources.*.num_threads", "reward.sources.*.micro_batch_size",
    "reward.sources.*.max_tokens_per_micro_batch",
]


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
    old, new = _flat(saved), _flat(config.model_dump(mode="json"))
    return [f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}"
            for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key) and not any(fnmatch.fnmatchcase(key, p) for p in MAY_CHANGE)]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
