"""The run's mailbox (`RunControl`, used without Ray) and how prompts are cut into requests."""

from __future__ import annotations

import pytest

from cluster.control import ControlError, RunControl, control_name
from cluster.rollout_pool import _split


def control_with_workers(ids):
    control = RunControl("/runs/gsm8k-1")
    control.publish({"step": 3, "workers": [{"id": i, "node_id": f"n{i}"} for i in ids]})
    return control


def test_scale_request_is_taken_once_and_a_later_one_replaces_it():
    control = control_with_workers([0, 1])
    assert control.take_request() is None
    assert control.request_scale(4) == {"run_dir": "/runs/gsm8k-1", "workers_now": 2, "num_workers": 4, "remove": []}
    control.request_scale(3)
    assert control.status()["pending"] == {"num_workers": 3, "remove": []}
    assert control.take_request() == {"num_workers": 3, "remove": []}
    assert control.take_request() is None


def test_removing_workers_by_id_keeps_the_rest_unless_a_size_is_given():
    control = control_with_workers([0, 1, 2])
    assert control.request_scale(None, [2, 0, 2])["num_workers"] == 1
    assert control.take_request() == {"num_workers": 1, "remove": [0, 2]}
    assert control.request_scale(3, [1])["num_workers"] == 3  # remove 1 and add two fresh ones


@pytest.mark.parametrize("num_workers, remove, message", [
    (0, [], "--rollout-workers must be between 1 and 4096, got 0"),
    (None, [0, 1], "--rollout-workers must be between 1 and 4096, got 0"),
    (2, [5], "no rollout worker with id 5; the run's workers are [0, 1]"),
])
def test_bad_requests_are_refused_with_one_line_and_leave_nothing_pending(num_workers, remove, message):
    control = control_with_workers([0, 1])
    with pytest.raises(ControlError) as err:
        control.request_scale(num_workers, remove)
    assert str(err.value) == message
    assert control.take_request() is None


def test_control_actor_is_named_after_the_run_directory():
    assert control_name("/shared/runs/gsm8k-1/") == "relay/gsm8k-1"


@pytest.mark.parametrize("count, pieces, expected", [
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (5, 2, [(0, 2), (2, 5)]),  # round(2.5) = 2: near-equal, contiguous
    (3, 8, [(0, 1), (1, 2), (2, 3)]),  # never an empty request
    (1, 1, [(0, 1)]),
])
def test_prompts_are_cut_into_contiguous_non_empty_requests(count, pieces, expected):
    assert _split(count, pieces) == expected
