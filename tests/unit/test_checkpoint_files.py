"""cluster.run.checkpoint on plain files: commit, latest, keeping the last M, crashes mid-write, replacing a step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.run import checkpoint
from cluster.run.checkpoint import COMPLETE_MARKER, begin, commit, latest, read_driver_state, validate


def fill(tmp: Path, step: int, cursor: int = 0) -> Path:
    """What the learner and the driver write into a `begin` directory (the learner's files as stand-ins)."""
    (tmp / "policy").mkdir()
    (tmp / "policy" / "config.json").write_text("{}")
    (tmp / "policy" / "model.safetensors").write_bytes(b"weights")
    (tmp / "learner_state.pt").write_bytes(b"state")
    checkpoint.write_driver_state(tmp, {"step": step, "weights_version": step, "data": {"batches": cursor}})
    checkpoint.write_config(tmp, "seed: 0\n")
    return tmp


def save(run_dir: Path, step: int, keep: int = 2, cursor: int = 0) -> Path:
    return commit(fill(begin(run_dir, step), step, cursor), run_dir, step, keep)


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_commit_then_latest_reads_the_driver_state(tmp_path):
    assert latest(tmp_path) is None
    path = save(tmp_path, 3, cursor=7)
    assert path == (tmp_path / "checkpoints" / "step_3").resolve()
    assert latest(tmp_path) == path and (path / COMPLETE_MARKER).is_file()
    assert read_driver_state(path) == {"step": 3, "weights_version": 3, "data": {"batches": 7}}
    assert (path / "config.yaml").read_text() == "seed: 0\n"
    assert names(tmp_path) == ["step_3"]  # no temporary directory left


def test_keeps_the_last_m_by_step_number(tmp_path):
    for step in (2, 9, 10, 100):  # numeric order, not string order ("step_100" < "step_2" as strings)
        save(tmp_path, step, keep=2)
    assert names(tmp_path) == ["step_10", "step_100"]
    assert latest(tmp_path).name == "step_100"


def test_crash_between_begin_and_commit_leaves_the_previous_checkpoint(tmp_path):
    previous = save(tmp_path, 5)
    fill(begin(tmp_path, 10), 10)  # fully written, but killed before commit: no marker, still a temporary name
    half = begin(tmp_path, 10)
    (half / "learner_state.pt").write_bytes(b"partial")  # killed mid-write
    assert latest(tmp_path) == previous
    assert len([n for n in names(tmp_path) if n.startswith(".tmp-")]) == 2


def test_directory_without_marker_is_never_latest(tmp_path):
    previous = save(tmp_path, 5)
    fake = tmp_path / "checkpoints" / "step_20"
    fake.mkdir()
    fill(fake, 20)  # every part, but no marker (say, copied by hand, or a commit that never reached it)
    assert latest(tmp_path) == previous
    with pytest.raises(ValueError, match=r"step_20 is incomplete: missing COMPLETE"):
        validate(fake)
    (fake / COMPLETE_MARKER).write_text("20\n")
    assert latest(tmp_path) == fake  # the marker is what makes it one
    (tmp_path / "checkpoints" / "step_007").mkdir()  # non-canonical names are not checkpoints either
    (tmp_path / "checkpoints" / "step_007" / COMPLETE_MARKER).write_text("")
    assert latest(tmp_path) == fake


def test_stale_temporary_directories_are_removed_at_the_next_commit(tmp_path):
    save(tmp_path, 1)
    fill(begin(tmp_path, 2), 2)  # a crashed attempt
    begin(tmp_path, 2)
    save(tmp_path, 2)
    assert names(tmp_path) == ["step_1", "step_2"]


def test_an_existing_step_is_replaced(tmp_path):
    save(tmp_path, 4, cursor=1)
    again = save(tmp_path, 4, cursor=2)
    assert read_driver_state(again)["data"] == {"batches": 2}
    assert names(tmp_path) == ["step_4"]


def test_commit_refuses_an_incomplete_or_mislabelled_directory(tmp_path):
    tmp = begin(tmp_path, 6)
    (tmp / "learner_state.pt").write_bytes(b"state")
    with pytest.raises(ValueError, match=r"missing driver_state.json, config.yaml, policy/config.json, "
                                         r"policy/\*.safetensors"):
        commit(tmp, tmp_path, 6, keep=2)
    with pytest.raises(ValueError, match="says step 5, committing step 6"):
        commit(fill(begin(tmp_path, 6), 5), tmp_path, 6, keep=2)
    assert latest(tmp_path) is None


def test_validate_names_the_path_and_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint .*nowhere does not exist"):
        validate(tmp_path / "nowhere")
    path = save(tmp_path, 1)
    validate(path)
    (path / "learner_state.pt").unlink()
    with pytest.raises(ValueError, match=r"step_1 is incomplete: missing learner_state.pt;"):
        read_driver_state(path)


def test_driver_state_is_strict_json(tmp_path):
    tmp = begin(tmp_path, 1)
    with pytest.raises(ValueError, match="Out of range float"):
        checkpoint.write_driver_state(tmp, {"step": 1, "weights_version": 1, "x": float("nan")})
    with pytest.raises(ValueError, match="integer 'weights_version'"):
        checkpoint.write_driver_state(tmp, {"step": 1})
    checkpoint.write_driver_state(tmp, {"step": 1, "weights_version": 1, "data": {"consumed": 3}})
    assert json.loads((tmp / "driver_state.json").read_text())["data"] == {"consumed": 3}


def test_file_names_match_the_learner_and_no_torch_is_imported():
    from learner import learner
    from sync.adapters import ADAPTER_CONFIG_FILE

    assert (checkpoint.POLICY_DIR, checkpoint.CRITIC_DIR, checkpoint.LEARNER_STATE_FILE, checkpoint.ADAPTER_CONFIG) == (
        learner.POLICY_DIR, learner.CRITIC_DIR, learner.LEARNER_STATE_FILE, ADAPTER_CONFIG_FILE)
    code = "import sys, cluster.run.checkpoint; assert not {'torch', 'ray'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
