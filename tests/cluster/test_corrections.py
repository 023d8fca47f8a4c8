"""The off-policy correction family (IcePop, sequence-masked TIS, CISPO) through the real loop: a local Ray, real
vLLM engines, the demo model. In float32 on-policy (the engines and the learner agree to rounding, so nothing may be
masked) and in bfloat16 one version stale (rollout.max_staleness=1: the corrections meet a real gap); each run
reports its variant's own metrics, and they hold together. Every run has one fleet shape (the learner on one thread,
as asynchronous runs set it, and no reference), so all six share one fleet (`fleets`)."""

from __future__ import annotations

import math

import pytest

from cluster.config import load_config
from cluster.run.launch import run_training
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

SMALL = ["max_steps=3", "data.prompts_per_step=8", "rollout.num_workers=1", "learner.kl_coef=0", "learner.lr=2e-3",
         "learner.num_threads=1"]
VARIANTS = {
    "icepop": ["learner.rollout_correction=icepop"],  # IcePop's band, [0.5, 5]
    "seq_mask_tis": ["learner.rollout_correction=seq_mask_tis"],  # its band per regime: BANDS
    "cispo": ["learner.policy_loss=cispo"],
}
REGIMES = {"float32": [], "bfloat16": ["rollout.max_staleness=1"]}
BANDS = {  # seq_mask_tis's band on the geometric mean: a narrow one on-policy; one version stale at this learning
    # rate a wider one keeps some sequences (the narrow one masks every sequence there from step 2 on)
    "float32": ["learner.rollout_correction_low=0.999", "learner.rollout_correction_high=1.002"],
    "bfloat16": ["learner.rollout_correction_low=0.9", "learner.rollout_correction_high=1.1"],
}
CORRECTION = "rollout_correction/"


def train(tmp_path, demo_model_dir, dtype: str, name: str, *extra: str) -> list[dict]:
    run_dir = tmp_path / f"{dtype}-{name}"
    config = load_config(None, [f"run_dir={run_dir}", f"model.path={demo_model_dir}", f"model.dtype={dtype}", *SMALL,
                                *REGIMES[dtype], *VARIANTS[name], *(BANDS[dtype] if name == "seq_mask_tis" else []),
                                *extra])
    records = run_training(config, run_dir, str(demo_model_dir), display=False, pool=POOL)
    assert len(records) == 3
    for r in records:  # every update was taken, and moved the policy
        assert r["train/skipped_updates"] == 0 and math.isfinite(r["loss/policy"]) and r["grad_norm"] > 0
    return records


def test_corrections_on_policy_in_float32_change_nothing_but_report_themselves(ray_local, tmp_path, demo_model_dir):
    """Engine and learner agree to ~1e-7 per token: no token or sequence is masked or capped, every weight is 1."""
    for name in ("icepop", "seq_mask_tis"):
        for r in train(tmp_path, demo_model_dir, "float32", name):
            assert r[f"{CORRECTION}masked_fraction"] == 0 and r["mismatch/kl"] < 1e-8
            assert r[f"{CORRECTION}weight_mean"] == pytest.approx(1.0, abs=1e-4)
            assert (f"{CORRECTION}capped_fraction" in r) == (name == "seq_mask_tis")
            if name == "seq_mask_tis":
                assert r[f"{CORRECTION}capped_fraction"] == 0
    # cispo with a tight upper bound on its weight and two updates a step: the second one's ratios leave 1, some
    # weights are clipped; the first one's are exactly 1
    records = train(tmp_path, demo_model_dir, "float32", "cispo",
                    "learner.num_minibatches=2", "learner.clip_high=0.001")
    assert all(0 < r["clip_fraction"] <= 0.5 for r in records)  # a mean over the two updates, the first clips none
    assert all(r["ratio_mean"] != 1 and abs(r["ratio_mean"] - 1) < 0.5 for r in records)
    assert not any(k.startswith(CORRECTION) for r in records for k in r)  # no correction asked for


def test_corrections_one_version_stale_in_bfloat16(ray_local, tmp_path, demo_model_dir):
    """Each step's batch comes from the previous weights, in bfloat16: the corrections see a real gap. Their metrics
    hold together: a masked token weighs 0, a kept one at most the band's (icepop) or the cap (seq_mask_tis)."""
    icepop = train(tmp_path, demo_model_dir, "bfloat16", "icepop")
    for r in icepop:
        masked, weight = r[f"{CORRECTION}masked_fraction"], r[f"{CORRECTION}weight_mean"]
        assert r["mismatch/kl"] > 0 and 0 <= masked < 0.5 and 0 < weight <= 5.0 * (1 - masked)
        assert f"{CORRECTION}capped_fraction" not in r
    assert icepop[-1][f"{CORRECTION}masked_fraction"] > 0  # a version stale at this lr, some ratios leave [0.5, 5]
    sequences = train(tmp_path, demo_model_dir, "bfloat16", "seq_mask_tis")
    for r in sequences:
        masked, capped = r[f"{CORRECTION}masked_fraction"], r[f"{CORRECTION}capped_fraction"]
        assert 0 <= masked <= 1 and 0 <= capped <= 1 - masked
        assert r[f"{CORRECTION}weight_mean"] <= 2.0 * (1 - masked) + 1e-6  # the cap, on the kept tokens only
    assert sequences[-1][f"{CORRECTION}masked_fraction"] > 0  # some sequences' mean ratio leaves [0.9, 1.1]
    # cispo beside the stale batches' default correction (tis): one update a step, so its ratio is exactly 1
    for r in train(tmp_path, demo_model_dir, "bfloat16", "cispo"):
        assert r["ratio_mean"] == 1 and r["clip_fraction"] == 0
        assert 0 < r[f"{CORRECTION}weight_mean"] <= 2.0 and 0 <= r[f"{CORRECTION}capped_fraction"] <= 1
