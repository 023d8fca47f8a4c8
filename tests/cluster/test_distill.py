"""On-policy distillation (`configs/distill.yaml`) on a real local Ray with real vLLM engines and the shipped demo
teacher in its own actor, in float32 (on-policy) and bfloat16 (asynchronous, one version stale): the teacher scores
every sampled token (`distill/reverse_kl`, `time/teacher`), no reference worker starts, and a run resumed from its
checkpoint repeats the original bit for bit. A teacher that is the policy itself gives a reverse KL of zero: the
teacher's logprobs line up token for token with the learner's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL
from tests.resume import assert_resume_repeats

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

PRESET = Path(__file__).resolve().parents[2] / "configs" / "distill.yaml"  # the preset, run here
MODES = {"float32": [], "bfloat16": ["rollout.max_staleness=1"]}  # on-policy; asynchronous


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_distillation_run_scores_every_token_with_its_teacher_and_resumes_exactly(ray_local, tmp_path,
                                                                                    demo_model_dir, dtype):
    overrides = [f"model.path={demo_model_dir}", f"model.dtype={dtype}", "max_steps=4", "data.prompts_per_step=8",
                 "checkpoint.every=2", "learner.num_threads=1", *MODES[dtype]]
    config = load_config(PRESET, [f"run_dir={tmp_path / 'run'}", *overrides])
    assert config.uses_teacher and not config.uses_reference  # the teacher is the anchor: no KL to a reference
    records = run_training(config, tmp_path / "run", display=False, pool=POOL)

    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["time/teacher"] >= 0 and "kl/mean" not in r and r["train/skipped_updates"] == 0
    # The demo model samples answers the teacher (after GRPO) finds much less likely: a large reverse KL per token,
    # shrinking as the policy moves towards the teacher (measured: 1.8 at step 1; docs/benchmarks.md)
    assert all(0.5 < r["distill/reverse_kl"] < 5 for r in records)

    # Resumed from step 2's checkpoint, the run repeats steps 3 and 4 bit for bit: the teacher is frozen, and its
    # logprobs of the same samples are the same bits.
    assert_resume_repeats(PRESET, tmp_path / "run", overrides, records)


def test_a_teacher_that_is_the_policy_itself_is_zero_reverse_kl_away(ray_local, tmp_path, demo_model_dir):
    """The teacher's logprobs (its own actor, its own passes) and the learner's of the same tokens agree to float32
    rounding: an off-by-one between the two, or the teacher scoring other tokens, would not."""
    config = load_config(PRESET, [f"run_dir={tmp_path / 'run'}", f"model.path={demo_model_dir}", "max_steps=2",
                                  "data.prompts_per_step=8", "learner.num_threads=1", f"teacher.path={demo_model_dir}"])
    records = run_training(config, tmp_path / "run", display=False, pool=POOL)
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["distill/reverse_kl"]) < 1e-5  # the step-1 policy is the teacher
    assert math.isfinite(records[1]["distill/reverse_kl"])
