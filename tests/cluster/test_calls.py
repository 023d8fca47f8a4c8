"""The one call helper (sync/calls.py) on real Ray actors: one outcome per actor, one deadline message, one error
line, the strict `get` that names the actor that failed, and `Later`, a call's value handed to another actor before
it exists."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray

from sync.calls import Later, RunError, call_all, get, wait_all

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class below travels by value


class Echo:
    def run(self, behaviour: str, value: int = 0):
        if behaviour == "raise":
            raise ValueError(f"bad value {value}")
        if behaviour == "die":
            os._exit(1)
        if behaviour == "sleep":
            time.sleep(30)
        if behaviour == "nap":
            time.sleep(1)
        return value

    def take(self, later: Later):
        """Whether `later`'s value existed when this call started, and the value."""
        ready, _ = ray.wait([later.ref], timeout=0)
        return bool(ready), later()


@pytest.fixture(scope="module")
def actors(ray_local):
    started = [ray_local.remote(Echo).options(num_cpus=0).remote() for _ in range(4)]
    ray.get([actor.run.remote("ok") for actor in started], timeout=300)  # started: the tests' deadlines time calls only
    yield started
    for actor in started:
        ray_local.kill(actor)


def test_every_outcome_says_what_happened_in_one_line(ray_local, actors):
    behaviours = [("ok", 1), ("raise", 2), ("die", 3), ("sleep", 4)]
    outcomes = call_all(actors, "run", list(behaviours), 3.0, "generate")
    assert [o.kind for o in outcomes] == ["ok", "raised", "died", "late"]
    assert outcomes[0].ok and outcomes[0].value == 1 and outcomes[0].error is None
    assert outcomes[1].error == "failed during 'generate' (ValueError: bad value 2)"
    assert outcomes[1].cause == "ValueError: bad value 2"
    assert outcomes[2].error.startswith("died during 'generate' (") and "\n" not in outcomes[2].error
    assert outcomes[3].error == "missed the 3 s deadline of 'generate'"


def test_get_names_the_actor_that_failed_and_returns_at_the_first_failure(ray_local):
    fresh = [ray_local.remote(Echo).options(num_cpus=0).remote() for _ in range(4)]
    try:
        started = time.monotonic()
        with pytest.raises(RunError, match=r"^worker b failed during 'sync': ValueError: bad value 7$"):
            get([fresh[0].run.remote("sleep"), fresh[1].run.remote("raise", 7)], 20.0, ["worker a", "worker b"],
                "sync")
        assert time.monotonic() - started < 10  # not the sleeping call's 30 s, nor the 20 s deadline
        with pytest.raises(RunError, match=r"^worker c missed the 1 s deadline of 'train' \(raise timeouts.train"):
            get([fresh[2].run.remote("ok"), fresh[1].run.remote("sleep")], 1.0, ["worker a", "worker c"], "train")
        assert [o.value for o in wait_all([fresh[2].run.remote("ok", 5)], 30.0, "sync")] == [5]
        with pytest.raises(RunError, match=r"^worker d died during 'train': ActorDiedError: "):  # the dead one named
            get([fresh[2].run.remote("ok"), fresh[3].run.remote("die")], 20.0, ["worker c", "worker d"], "train")
    finally:
        for actor in fresh:
            ray_local.kill(actor)


def test_a_later_value_reaches_the_actor_it_is_handed_to_unresolved_and_its_failures_name_the_producer(ray_local):
    fresh = [ray_local.remote(Echo).options(num_cpus=0).remote() for _ in range(3)]
    producer, receiver, sleeper = fresh
    try:
        later = Later(producer.run.remote("nap", 7), 30.0, "reference", "reference")
        assert get([receiver.take.remote(later)], 30.0, ["learner"], "train") == [(False, 7)]  # started before it
        failing = Later(producer.run.remote("raise", 3), 30.0, "reference", "reference")
        with pytest.raises(RunError, match=r"^learner failed during 'train': RunError: reference failed during "
                                           r"'reference': ValueError: bad value 3$"):
            get([receiver.take.remote(failing)], 30.0, ["learner"], "train")
        late_one = Later(sleeper.run.remote("sleep"), 1.0, "reference", "reference")
        with pytest.raises(RunError, match=r"^learner failed during 'train': RunError: reference missed the 1 s "
                                           r"deadline of 'reference'"):
            get([receiver.take.remote(late_one)], 30.0, ["learner"], "train")
    finally:
        for actor in fresh:
            ray_local.kill(actor)
