"""The run's mailbox (`RunControl`, used without Ray) and how prompts are shared over rollout workers."""

from __future__ import annotations

import pytest

from cluster.fleet.control import ControlError, RunControl, run_name


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
    (2, [0, 1], "removing every serving rollout worker ([0, 1]) leaves none to generate until new ones start; keep at "
                "least one"),
])
def test_bad_requests_are_refused_with_one_line_and_leave_nothing_pending(num_workers, remove, message):
    control = control_with_workers([0, 1])
    with pytest.raises(ControlError) as err:
        control.request_scale(num_workers, remove)
    assert str(err.value) == message
    assert control.take_request() is None


def test_a_run_is_named_after_its_run_directory():
    assert run_name("/shared/runs/gsm8k-1/") == "gsm8k-1"


class FakePool:
    """Just what RolloutPool._shares reads: the fleet's worker ids, the measured speeds and the balance mode."""

    def __init__(self, ids, speeds, balance="speed"):
        from types import SimpleNamespace

        self.fleet = SimpleNamespace(rollout=[SimpleNamespace(id=i) for i in ids])
        self.speeds = speeds
        self.config = SimpleNamespace(rollout=SimpleNamespace(balance=balance))


@pytest.mark.parametrize("ids, speeds, balance, count, expected", [
    ([0, 1], {}, "speed", 32, [16, 16]),  # nothing measured yet: equal shares
    ([0, 1], {0: 30.0, 1: 10.0}, "speed", 32, [24, 8]),  # 1 each, then 30 split 3:1: 22.5, 7.5; tie -> first
    ([0, 1], {0: 30.0, 1: 10.0}, "even", 32, [16, 16]),
    ([0, 1, 5], {0: 30.0, 1: 10.0}, "speed", 12, [6, 2, 4]),  # the new worker 5 counts as the mean (20)
    ([0, 1], {0: 1000.0, 1: 1.0}, "speed", 8, [7, 1]),  # never 0 while there are enough prompts: keeps measuring
    ([0, 1, 2], {}, "speed", 2, [1, 1, 0]),  # fewer prompts than workers
    # within 10% of the median (noise, or a fixed per-call cost): equal shares, not 9/7/8/8 (the 9 would set the pace)
    ([0, 1, 2, 3], {0: 10.8, 1: 9.2, 2: 10.0, 3: 10.0}, "speed", 32, [8, 8, 8, 8]),
    ([0, 1, 2, 3], {0: 12.0, 1: 10.0, 2: 10.0, 3: 10.0}, "speed", 32, [9, 8, 8, 7]),  # 20% faster: a real difference
])
def test_prompts_are_shared_in_proportion_to_measured_speed(ids, speeds, balance, count, expected):
    from cluster.fleet.rollout_pool import RolloutPool

    shares = RolloutPool._shares(FakePool(ids, speeds, balance), count)
    assert shares == expected and sum(shares) == count
