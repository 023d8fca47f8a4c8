"""DAPO's soft overlong punishment against hand-computed values, and its argument checks."""

import pytest

from rewards.shaping import overlong_penalty


@pytest.mark.parametrize(
    ("length", "max_length", "buffer", "penalty", "expected"),
    [
        # max 8, buffer 4: no penalty up to 8 - 4 = 4, then (4 - length) / 4, then -1 past 8.
        (0, 8, 4, 1.0, 0.0),
        (3, 8, 4, 1.0, 0.0),
        (4, 8, 4, 1.0, 0.0),  # the boundary itself is free: length <= max_length - buffer
        (5, 8, 4, 1.0, -0.25),  # (4 - 5) / 4
        (6, 8, 4, 1.0, -0.5),  # (4 - 6) / 4
        (7, 8, 4, 1.0, -0.75),  # (4 - 7) / 4
        (8, 8, 4, 1.0, -1.0),  # (4 - 8) / 4: the ramp reaches -penalty at max_length
        (9, 8, 4, 1.0, -1.0),  # past max_length: -penalty
        (100, 8, 4, 1.0, -1.0),
        # penalty scales the whole curve: (4 - 6) / 4 * 0.5 = -0.25; past the end -0.5
        (6, 8, 4, 0.5, -0.25),
        (9, 8, 4, 0.5, -0.5),
        # penalty 0: every length is free
        (6, 8, 4, 0.0, 0.0),
        (9, 8, 4, 0.0, 0.0),
        # max 10, buffer 5: (5 - 6) / 5 = -0.2, (5 - 9) / 5 = -0.8
        (6, 10, 5, 1.0, -0.2),
        (9, 10, 5, 1.0, -0.8),
        # buffer 1: the ramp is one step wide, max_length itself is already -penalty: (9 - 10) / 1 = -1
        (9, 10, 1, 2.0, 0.0),
        (10, 10, 1, 2.0, -2.0),
        # buffer max_length - 1: (1 - 2) / 3 = -1/3
        (1, 4, 3, 1.0, 0.0),
        (2, 4, 3, 1.0, -1 / 3),
        # buffer 0 turns the shaping off, even past max_length
        (8, 8, 0, 1.0, 0.0),
        (9, 8, 0, 1.0, 0.0),
    ],
)
def test_overlong_penalty_matches_hand_computed_values(length, max_length, buffer, penalty, expected):
    assert overlong_penalty(length, max_length, buffer, penalty) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_overlong_penalty_defaults_to_a_penalty_of_one():
    assert overlong_penalty(6, 8, 4) == -0.5  # (4 - 6) / 4 * 1, exact in binary


@pytest.mark.parametrize(
    ("max_length", "buffer", "penalty", "named"),
    [
        (8, 8, 1.0, "buffer"),  # buffer must be < max_length
        (8, 9, 1.0, "buffer"),
        (8, -1, 1.0, "buffer"),
        (0, 0, 1.0, "buffer"),  # [0, 0) is empty
        (8, 4, -0.5, "penalty"),
    ],
)
def test_overlong_penalty_rejects_bad_arguments_naming_them(max_length, buffer, penalty, named):
    with pytest.raises(ValueError, match=named):
        overlong_penalty(5, max_length, buffer, penalty)


def test_overlong_penalty_rejects_negative_length():
    with pytest.raises(ValueError, match="length"):
        overlong_penalty(-1, 8, 4)
