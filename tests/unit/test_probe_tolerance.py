"""The probe's gap, its noise floor over several draws before the first update and the tolerance derived from it,
and its rule for an engine that repeats an earlier probe bit for bit (sync/verify.py; applied by
cluster/fleet/weight_sync.py)."""

from __future__ import annotations

import pytest

from sync.verify import (
    PROBE_NOISE_SEEDS,
    PROBE_SEED,
    ProbeRecord,
    SyncError,
    next_probe_record,
    probe_gap,
    probe_noise,
    probe_tolerance_from,
    stale_probe,
)


def test_the_gap_is_the_root_mean_square_of_the_token_gaps():
    # token gaps 0.1, 0.7, 0.1, 0.1: sqrt((0.01 + 0.49 + 0.01 + 0.01) / 4) = sqrt(0.13) = 0.36056
    assert probe_gap([-0.6, -2.7, -0.2, -1.1], [-0.5, -2.0, -0.3, -1.0]) == pytest.approx(0.13**0.5)
    assert probe_gap([-0.5, -1.25], [-0.5, -1.25]) == 0.0
    assert probe_gap([], []) == 0.0  # an engine that sampled no token: nothing to compare


def test_a_gap_over_tokens_the_two_sides_do_not_share_is_an_error_and_a_nan_fails_the_check():
    with pytest.raises(ValueError, match="engine scored 2 probe tokens, the learner 0"):
        probe_gap([-0.5, -1.25], [])  # e.g. a probe the learner never scored: not a gap of 0
    gap = probe_gap([-0.5, float("nan")], [-0.5, -1.25])
    assert not gap <= 1.0  # the check `not gap <= tolerance` stops the run


def test_one_unlikely_token_moves_the_gap_less_than_the_largest_token_gap():
    """The bfloat16 demo at lr 2e-3 on an AVX2 CPU (tests/cluster/test_reference_refresh.py): the first probe's token
    gaps were 0.0109, 0, 1.1e-4; version 3's were 8e-7 and 0.0974 (a token of logprob -0.46, the logits saturated),
    9x the first's largest, 11x its root mean square; both stay under bfloat16's minimum tolerance."""
    first = probe_gap([-3.4497, -3.4095, -0.40043], [-3.4388, -3.4095, -0.40054])
    third = probe_gap([-8.3e-7, -0.55744], [0.0, -0.46002])
    assert first == pytest.approx(((0.0109**2 + 0.00011**2) / 3) ** 0.5, rel=1e-3)  # 0.0063
    assert third == pytest.approx(((8.3e-7**2 + 0.09742**2) / 2) ** 0.5, rel=1e-3)  # 0.0689
    tolerance = probe_tolerance_from(probe_noise([([-3.4497, -3.4095, -0.40043], [-3.4388, -3.4095, -0.40054])]),
                                     ["rollout worker 0"], "bfloat16")
    assert tolerance == 2.0**-3 and third < tolerance


def test_the_noise_floor_is_the_largest_gap_of_several_draws():
    """A draw that sampled only likely tokens measures almost no bfloat16 noise; the next draw may sample an unlikely
    one. The floor is the largest draw's gap."""
    draws = [([-0.01, -0.02], [-0.01, -0.0201]),  # gap sqrt(1e-8 / 2) = 7.1e-5
             ([-0.5, -4.0], [-0.5, -4.3]),  # token gaps 0, 0.3: gap sqrt(0.09 / 2) = 0.2121
             ([-1.0, -2.0], [-1.2, -1.8])]  # token gaps 0.2, 0.2: gap 0.2
    assert probe_noise(draws) == pytest.approx(0.045**0.5)
    assert probe_noise([]) == 0.0
    assert probe_tolerance_from(probe_noise(draws), ["rollout worker 0"], "bfloat16") == pytest.approx(3 * 0.045**0.5)
    # the first draw alone would have given bfloat16's minimum, which the second draw's gap exceeds
    assert probe_tolerance_from(probe_noise(draws[:1]), ["rollout worker 0"], "bfloat16") < probe_noise(draws)


def test_the_noise_draws_start_with_the_seed_every_later_probe_uses():
    assert PROBE_NOISE_SEEDS[0] == PROBE_SEED and len(set(PROBE_NOISE_SEEDS)) == len(PROBE_NOISE_SEEDS) >= 8


def test_float32_noise_gives_the_minimum_and_bfloat16_noise_three_times_itself():
    assert probe_tolerance_from(4.8e-7, ["rollout worker 0"]) == 1e-4  # float32: engines agree to ~1e-6
    assert probe_tolerance_from(0.0, ["rollout worker 0"]) == 1e-4
    assert probe_tolerance_from(0.06, ["rollout worker 0"], "bfloat16") == pytest.approx(0.18)


def test_a_bfloat16_floor_below_a_third_of_an_ulp_of_large_logits_gives_bfloat16s_minimum():
    """A floor measured on small logits (the demo's first probes: ~1e-2) is not the noise of logits that training
    sharpened: the minimum, one bfloat16 ulp of a logit of 16 to 32, covers them."""
    assert probe_tolerance_from(0.0, ["rollout worker 0"], "bfloat16") == 2.0**-3
    assert probe_tolerance_from(1.07e-2, ["rollout worker 0"], "bfloat16") == 2.0**-3
    assert probe_tolerance_from(4.8e-7, ["rollout worker 0"], "bfloat16") == 2.0**-3


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
    assert stale_probe(start, record(1, (-0.5, -1.25001)), 0.0) is None  # 1e-5 < 1e-4 / 3
    assert stale_probe(start, record(1, (-0.5, -1.2499)), 0.0) == pytest.approx(1e-4)
