"""The probe's tolerance derived from the noise floor before the first update, and its rule for an engine that
repeats an earlier probe bit for bit (cluster/fleet/rollout_pool.py)."""

from __future__ import annotations

import pytest

from sync.verify import ProbeRecord, SyncError, next_probe_record, probe_tolerance_from, stale_probe


def test_float32_noise_gives_the_minimum_and_bfloat16_noise_five_times_itself():
    assert probe_tolerance_from(4.8e-7, ["rollout worker 0"]) == 1e-4  # float32: engines agree to ~1e-6
    assert probe_tolerance_from(0.0, ["rollout worker 0"]) == 1e-4
    # bfloat16, measured on the demo: 5x the floor
    assert probe_tolerance_from(1.07e-2, ["rollout worker 0"], "bfloat16") == pytest.approx(5.35e-2)


def test_a_bfloat16_floor_of_near_certain_tokens_gives_bfloat16s_minimum():
    """The calc demo model's first probe in bfloat16 measured 0 (its tokens near-certain), its next 2.4e-4: a float32
    minimum (1e-4) would stop a correct run."""
    assert probe_tolerance_from(0.0, ["rollout worker 0"], "bfloat16") == 2.0**-5
    assert probe_tolerance_from(4.8e-7, ["rollout worker 0"], "bfloat16") > 100 * 2.4e-4


@pytest.mark.parametrize("gap", [0.3, float("nan"), float("inf")])
def test_a_first_gap_that_is_not_numerics_stops_the_run(gap):
    with pytest.raises(SyncError, match=r"before the first update.*rollout worker 0, rollout worker 1.*not numerics"):
        probe_tolerance_from(gap, ["rollout worker 0", "rollout worker 1"])


def record(version, learner, engine=(-0.5, -1.25), weights=None, tokens=(5, 6)):
    return ProbeRecord(version, weights or f"digest {version}", tokens, engine, learner)


def test_an_engine_that_repeats_its_probe_while_the_learner_moved_beyond_the_noise_is_stale():
    """bfloat16 numbers: noise floor 1.07e-2, one step at lr 1e-6 moves the learner's probe logprobs by 2.5e-4 to
    1.5e-2 (measured on the demo); the engine, stale, repeats its probe exactly."""
    noise = 1.07e-2
    start = record(0, (-0.5, -1.25))
    one_step = record(1, (-0.5, -1.2375))  # moved 1.25e-2
    assert stale_probe(start, one_step, noise) == pytest.approx(1.25e-2)
    small = record(1, (-0.5, -1.245))  # moved 5e-3: within the noise, no verdict yet ...
    assert stale_probe(start, small, noise) is None
    kept = next_probe_record(start, small)
    assert kept == start  # ... and the engine's unchanged probe keeps the earlier record,
    assert stale_probe(kept, record(2, (-0.5, -1.235)), noise) == pytest.approx(1.5e-2)  # so the moves add up


def test_an_engine_that_moved_or_weights_that_did_not_change_are_never_stale():
    start = record(0, (-0.5, -1.25))
    moved_engine = record(1, (-0.4, -1.0), engine=(-0.5, -1.2500001))  # one bit of change is enough
    assert stale_probe(start, moved_engine, 1e-2) is None
    assert next_probe_record(start, moved_engine) == moved_engine
    same_weights = record(1, (-0.4, -1.0), weights="digest 0")  # e.g. every update rounded away in bfloat16
    assert stale_probe(start, same_weights, 1e-2) is None
    other_tokens = record(1, (-0.4, -1.0), tokens=(5, 7))  # a different sample: the engine's logits changed
    assert stale_probe(start, other_tokens, 1e-2) is None
    assert stale_probe(None, start, 1e-2) is None  # a first probe


def test_float32_engines_that_agree_exactly_still_need_a_move_above_the_minimum():
    start = record(0, (-0.5, -1.25))
    assert stale_probe(start, record(1, (-0.5, -1.25001)), 0.0) is None  # 1e-5 < 1e-4 / 5
    assert stale_probe(start, record(1, (-0.5, -1.2499)), 0.0) == pytest.approx(1e-4)
