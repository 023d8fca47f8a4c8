"""Rollout actors that the tests' pool (`ParkingPool`, tests/fleets.py) can re-initialise as another kind of rollout
worker.

Owns: `PooledRolloutWorker`, the class a pooled run's rollout actors are started with, and `reinit_as`.
Does not own: when a fleet is reused (`ParkingPool`), or starting actors (cluster/fleet/placement.py).

Ray dispatches each call to the function the actor's class had when the actor started, so an actor started for one
subclass of `RolloutWorker` could only ever run that subclass's methods, and a run with another subclass (the tests'
fault-injecting workers) had to start new processes: imports are most of a rollout worker's ~10 s start on 2 cores.
`PooledRolloutWorker`'s public methods call the method of the instance's class at call time instead, and its
constructor takes the class to be: an instance made by `PooledRolloutWorker(cls, *args)` is a `cls` in every way
(`type(instance) is cls`, the same constructor, the same methods); `reinit_as` turns it into another class's instance
in place, as if its process had just started it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from actors.rollout import RolloutWorker


def _forward(name: str, method: Any) -> Any:
    @functools.wraps(method)  # the signature Ray checks the caller's arguments against
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(type(self), name)(self, *args, **kwargs)
    return call


def _init(self: Any, cls: type, *args: Any, **kwargs: Any) -> None:
    if not issubclass(cls, RolloutWorker):
        raise TypeError(f"a pooled rollout actor hosts RolloutWorker subclasses, not {cls.__name__}")
    self.__class__ = cls
    cls.__init__(self, *args, **kwargs)


PooledRolloutWorker = type("PooledRolloutWorker", (RolloutWorker,), {
    "__module__": __name__, "__init__": _init,
    **{name: _forward(name, method) for name, method in inspect.getmembers(RolloutWorker, inspect.isfunction)
       if not name.startswith("_")},
})


def reinit_as(instance: Any, cls: type, *args: Any, **kwargs: Any) -> None:
    """Run inside a pooled rollout actor (`__ray_call__`): shut its engine down, drop its state and construct it
    again as a `cls` with these arguments."""
    instance.shutdown()
    instance.__dict__.clear()
    _init(instance, cls, *args, **kwargs)
