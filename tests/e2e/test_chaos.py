"""bench/chaos.py at a small size: the learner's process SIGKILLed after step 2 of a 4-step demo run (`relay train`, a
checkpoint every 2 steps), or the driver's after step 1 (before any checkpoint), stops the run; `relay train ...
resume=auto` then finishes it, every step recorded once, and every step's reward, KL, loss and length are those of the
run without the fault (exact resume). A killed rollout worker or reference needs no resume:
tests/cluster/test_faults.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.chaos import COMPARED, killer, records, settings_args, train  # noqa: E402

ARGS = settings_args(workers=1, asynchronous=False, steps=4, overrides=[])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chaos") / "clean"
    assert train(run_dir, ARGS) == 0
    return records(run_dir)


# After step 2 the run has a checkpoint (every 2 steps) to resume from; after step 1 it has none, and resume=auto
# starts it again, the first attempt's records dropped (they were counted twice before).
@pytest.mark.parametrize("kind, after_step", [("learner", 2), ("driver", 1)])
def test_a_killed_learner_or_driver_resumes_to_the_run_without_the_fault(tmp_path, clean, kind, after_step):
    run_dir, killed = tmp_path / kind, []
    assert train(run_dir, ARGS, kill=killer(kind, run_dir, after_step=after_step, delay=0.1, killed=killed)) != 0
    assert killed and len(records(run_dir)) < 4  # the fault happened, and stopped the run
    assert train(run_dir, ARGS, resume=True) == 0
    got = records(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in COMPARED:
        assert [r[key] for r in got] == [r[key] for r in clean], key
