"""Checkpoint directories of a run: the layout, the atomic commit, keeping the last M, and finding the latest.

Owns: `run_dir/checkpoints/step_<N>/` (its layout: the comment above the file names below) and its commit protocol
(fill a temporary directory beside it, fsync, write the `COMPLETE` marker last, rename into place, fsync the parent),
so that a run killed at any moment leaves every earlier checkpoint intact and never a half-written one under a
`step_<N>` name; deleting checkpoints beyond the last `keep` and stale temporary directories; the driver's part
(`driver_state.json`, JSON only, and `config.yaml`).
Does not own: what the learner writes (`Learner.save_checkpoint`), the reference (cluster/fleet/reference_refresh.py),
the replay buffer (cluster/run/replay.py) or the fine-tuned reward models (`RewardModelWorker.save_state`), when to
checkpoint (cluster/run/trainer.py) or which checkpoint to resume from (cluster/run/resume.py). Pure filesystem:
imports neither Ray nor torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
DRIVER_STATE_FILE = "driver_state.json"
CONFIG_FILE = "config.yaml"
# Layout of a complete checkpoint, step_<N>/:
#   policy/            Hugging Face causal LM (safetensors + tokenizer): transformers and vLLM load it; with
#                      `learner.lora`, the adapters in peft's format (`relay export --merge` merges them)
#   critic/            the value model, with a critic only
#   reference/         the reference's weights, once `reference.refresh_every` refreshed it
#   learner_state.pt   optimizers, schedulers, RNG states, counters (`torch.load(weights_only=True)`)
#   replay.npz         the replay buffer's groups, with `data.replay_fraction` > 0 (flat arrays, no pickle)
#   reward_models/<name>/  a reward model fine-tuned during the run (`train`): weights and optimizer state
#   driver_state.json  step, weights version, data cursor, ...
#   config.yaml        the run's resolved config
#   COMPLETE           written last: a directory without it is never a checkpoint
# Written by the learner; the same names as learner.learner's POLICY_DIR, CRITIC_DIR, LEARNER_STATE_FILE (tested).
POLICY_DIR = "policy"
CRITIC_DIR = "critic"
LEARNER_STATE_FILE = "learner_state.pt"
ADAPTER_CONFIG = "adapter_config.json"  # in `policy/` with LoRA (sync/adapters.py's ADAPTER_CONFIG_FILE; tested)
TMP_PREFIX = ".tmp-"  # checkpoint being written, or one being replaced or deleted: never read, removed on commit
_STEP_NAME = re.compile(r"step_(0|[1-9][0-9]*)")  # canonical only: `step_07` would be a second name for step 7


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory's name, or None if it is not one."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).resolve() / CHECKPOINTS_DIR


def begin(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh, empty temporary directory in `run_dir/checkpoints/` for step `step`'s checkpoint (an absolute path,
    for the learner to write its part into); `commit` turns it into `step_<N>`."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    return tmp


def write_driver_state(tmp_dir: str | os.PathLike, state: dict[str, Any]) -> None:
    """The driver's state as strict JSON (no NaN); it must hold at least `step` and `weights_version`."""
    for key in ("step", "weights_version"):
        if not isinstance(state.get(key), int):
            raise ValueError(f"driver state needs an integer '{key}', got {state.get(key)!r}")
    _write_text(Path(tmp_dir) / DRIVER_STATE_FILE, json.dumps(state, indent=2, sort_keys=True, allow_nan=False))


def write_config(tmp_dir: str | os.PathLike, text: str) -> None:
    """The run's resolved config (YAML text), as `run_dir/config.yaml` holds it."""
    _write_text(Path(tmp_dir) / CONFIG_FILE, text)


def read_driver_state(path: str | os.PathLike) -> dict[str, Any]:
    """The driver state of a complete checkpoint (ValueError if `path` is not one)."""
    validate(path)
    return json.loads((Path(path) / DRIVER_STATE_FILE).read_text())


def commit(tmp_dir: str | os.PathLike, run_dir: str | os.PathLike, step: int, keep: int) -> Path:
    """Make a filled `begin` directory the checkpoint `step_<step>` atomically, then keep only the last `keep`
    complete checkpoints (by step; never the one just committed) and remove stale temporary directories.
    An existing `step_<step>` (from an earlier attempt) is replaced. Returns the checkpoint's path."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    tmp, root = Path(tmp_dir).resolve(), checkpoints_dir(run_dir)
    if tmp.parent != root or not tmp.name.startswith(TMP_PREFIX):
        raise ValueError(f"{tmp} was not made by checkpoint.begin for {root}; commit only renames within it")
    missing = _missing(tmp, with_marker=False)
    if missing:
        raise ValueError(f"checkpoint {tmp} is missing {', '.join(missing)}; write every part before committing")
    saved_step = json.loads((tmp / DRIVER_STATE_FILE).read_text()).get("step")
    if saved_step != step:
        raise ValueError(f"checkpoint {tmp}: {DRIVER_STATE_FILE} says step {saved_step}, committing step {step}")
    _fsync_tree(tmp)  # every byte on disk before the marker claims the checkpoint is complete
    _write_text(tmp / COMPLETE_MARKER, f"{step}\n")
    _fsync_dir(tmp)
    final = root / checkpoint_name(step)
    displaced = None
    if final.exists():
        # rename() cannot replace a non-empty directory: move the old one aside first. A crash between the two
        # renames loses only this step's old copy (it stays under a temporary name); earlier steps are untouched.
        displaced = root / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}-{time.time_ns()}"
        os.rename(final, displaced)
    os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, keep, final)
    return final


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in `run_dir`, or None; temporary and incomplete directories
    (no `COMPLETE` marker) are ignored."""
    complete = _complete_checkpoints(checkpoints_dir(run_dir))
    return complete[-1][1] if complete else None


def validate(path: str | os.PathLike) -> None:
    """Raise a one-line ValueError naming `path` and what it lacks, unless it is a complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist or is not a directory; pass a run_dir/checkpoints/"
                         "step_<N> directory")
    missing = _missing(path, with_marker=True)
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}; resume from another "
                         f"step_<N> in {path.parent}")


def _missing(path: Path, with_marker: bool) -> list[str]:
    """The required parts `path` lacks (the critic is optional: the learner checks it against the run's config)."""
    # The policy: a model directory, or with `learner.lora` a peft adapter directory.
    policy = f"{POLICY_DIR}/{ADAPTER_CONFIG}" if (path / POLICY_DIR / ADAPTER_CONFIG).is_file() else \
        f"{POLICY_DIR}/config.json"
    missing = [name for name in ([COMPLETE_MARKER] if with_marker else []) + [DRIVER_STATE_FILE, CONFIG_FILE,
               LEARNER_STATE_FILE, policy] if not (path / name).is_file()]
    if not any((path / POLICY_DIR).glob("*.safetensors")):
        missing.append(f"{POLICY_DIR}/*.safetensors")
    return missing


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(parse_step(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((step, p) for step, p in found if step is not None and (p / COMPLETE_MARKER).is_file())


def _prune(root: Path, keep: int, committed: Path) -> None:
    """Delete complete checkpoints beyond the newest `keep` and every temporary directory. A checkpoint is renamed
    to a temporary name before it is deleted, so a crash mid-deletion never leaves a partial `step_<N>`."""
    complete = _complete_checkpoints(root)
    for _, path in complete[:-keep]:
        if path != committed:
            os.rename(path, root / f"{TMP_PREFIX}deleting-{path.name}-{os.getpid()}-{time.time_ns()}")
    _fsync_dir(root)
    for path in root.iterdir():
        if path.name.startswith(TMP_PREFIX) and path.is_dir():
            shutil.rmtree(path)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (the learner's files were written without fsync)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (created or renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
