"""tests/rehost.py without Ray: a pooled rollout actor's methods are the instance's class's, chosen at call
time, with RolloutWorker's signatures (Ray checks a call's arguments against them)."""

from __future__ import annotations

import inspect

import pytest

from actors.rollout import RolloutWorker
from tests.rehost import PooledRolloutWorker, reinit_as


class Quiet(RolloutWorker):
    def __init__(self, tag):  # no engine
        self.tag = tag

    def generate(self, prompts, seeds, sampling, *load, **probe):
        return ("quiet", self.tag, len(prompts))

    stopped: list = []

    def shutdown(self):
        Quiet.stopped.append(self.tag)


class Loud(Quiet):
    def generate(self, prompts, seeds, sampling, *load, **probe):
        return ("loud", self.tag)


def test_every_public_method_forwards_to_the_instance_class_with_its_signature():
    public = {n for n, _ in inspect.getmembers(RolloutWorker, inspect.isfunction) if not n.startswith("_")}
    assert public and all(PooledRolloutWorker.__dict__[n] is not RolloutWorker.__dict__.get(n) for n in public)
    assert all(inspect.signature(getattr(PooledRolloutWorker, n)) == inspect.signature(getattr(RolloutWorker, n))
               for n in public)
    worker = object.__new__(PooledRolloutWorker)
    PooledRolloutWorker.__init__(worker, Quiet, "a")  # what Ray's actor creation runs
    assert type(worker) is Quiet and worker.tag == "a"
    assert PooledRolloutWorker.generate(worker, ["p"], [0], None) == ("quiet", "a", 1)  # what Ray's dispatch runs
    reinit_as(worker, Loud, "b")
    assert Quiet.stopped == ["a"] and type(worker) is Loud and worker.__dict__ == {"tag": "b"}  # old state gone
    assert PooledRolloutWorker.generate(worker, ["p"], [0], None) == ("loud", "b")


def test_only_rollout_workers_are_hosted():
    with pytest.raises(TypeError, match="RolloutWorker subclasses, not dict"):
        PooledRolloutWorker.__init__(object.__new__(PooledRolloutWorker), dict)
