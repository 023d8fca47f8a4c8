"""The probe's tolerance derived from the noise floor before the first update (cluster/rollout_pool.py)."""

from __future__ import annotations

import pytest

from cluster.rollout_pool import SyncError, probe_tolerance_from


def test_float32_noise_gives_the_minimum_and_bfloat16_noise_five_times_itself():
    assert probe_tolerance_from(4.8e-7, ["rollout worker 0"]) == 1e-4  # float32: engines agree to ~1e-6
    assert probe_tolerance_from(1.07e-2, ["rollout worker 0"]) == pytest.approx(5.35e-2)  # bfloat16, measured demo
    assert probe_tolerance_from(0.0, ["rollout worker 0"]) == 1e-4


@pytest.mark.parametrize("gap", [0.3, float("nan"), float("inf")])
def test_a_first_gap_that_is_not_numerics_stops_the_run(gap):
    with pytest.raises(SyncError, match=r"before the first update.*rollout worker 0, rollout worker 1.*not numerics"):
        probe_tolerance_from(gap, ["rollout worker 0", "rollout worker 1"])
