"""The environment interface of multi-turn episodes (docs/environments.md), and episodes on in-process environments.

Owns: `StepResult` and the `Environment` protocol (one object per episode: `reset(prompt, label)` gives the initial
observation, `step(action)` answers one turn), `load_environment` (a `package.module:Class` spec and params -> a
factory of environments), the async interface the episode loop drives (`Environments.open()` -> `EpisodeSession`
with `reset` / `step` / `close`), `EpisodeError` (an episode's environment call failed), `CallStats` (the metrics
both kinds of `Environments` report), and `InProcessEnvironments` (sessions on environment objects of this process,
each call in a thread pool under a deadline: its docstring gives the decisions).
Does not own: the episode loop (actors/episodes.py: generation, tokenising observations, masking,
`rollout.max_turns`), nor the remote protocol (rewards/environments/remote.py, rewards/environments/service.py).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from rewards.specs import check_params, import_spec

log = logging.getLogger(__name__)

METRIC_KEYS = ("calls", "retries", "failures", "latency_mean_s", "latency_max_s")


@dataclass
class StepResult:
    """What an environment answers to one action."""

    observation: str
    """Text appended to the episode after the action (a tool's output, feedback); may be empty."""
    reward: float = 0.0
    """This turn's reward (a finite number)."""
    done: bool = False
    """The episode is over: no more turns."""
    info: dict = field(default_factory=dict)
    """JSON-able extras for the loop, e.g. `{"invalid_call": True}` (counted by the loop)."""


class Environment(Protocol):
    """One episode's environment: a plain class, one instance per episode, called from one thread at a time.

    It may also have a `close()` method, called once when the episode's session ends (free a sandbox, a process).
    """

    def reset(self, prompt: str, label: Any) -> str:
        """Start the episode for `prompt` (the dataset's label beside it); return the initial observation, appended
        after the prompt (often "")."""
        ...

    def step(self, action: str) -> StepResult:
        """Answer the model's text of this turn."""
        ...


class EpisodeSession(Protocol):
    """One episode's environment as the loop drives it: `reset` once, then `step` per turn until `done`, then
    `close`. Calls on one session are sequential; many sessions run at once."""

    async def reset(self, prompt: str, label: Any) -> str:
        ...

    async def step(self, action: str) -> StepResult:
        ...

    async def close(self) -> None:
        ...


class Environments(Protocol):
    """Opens episode sessions: `InProcessEnvironments` or `RemoteEnvironments` (rewards/environments/remote.py)."""

    def open(self) -> EpisodeSession:
        """A new session; no I/O until its `reset`."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """The metrics since the last call (`METRIC_KEYS`), then reset them."""
        ...

    def close(self) -> None:
        """Release threads and connections; sessions still open are not closed (a service expires them)."""
        ...


class EpisodeError(RuntimeError):
    """An environment call of an episode failed (raised, returned a wrong value, timed out, or the service failed);
    the message is one line. The loop applies the run's failure policy (stop the run, or drop the group)."""


class CallStats:
    """Counters of environment calls, updated from any thread. `take` returns them (`METRIC_KEYS`) and resets them.

    calls: reset / step / close calls made. retries: requests sent again (remote only). failures: calls that failed
    (raised `EpisodeError`, or a close that failed). latency: of successful attempts (one thread call, one request).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zero()

    def _zero(self) -> None:
        self.calls = self.retries = self.failures = 0
        self.latency_count, self.latency_sum, self.latency_max = 0, 0.0, 0.0

    def add(self, *, calls: int = 0, retries: int = 0, failures: int = 0) -> None:
        with self._lock:
            self.calls += calls
            self.retries += retries
            self.failures += failures

    def latency(self, seconds: float) -> None:
        with self._lock:
            self.latency_count += 1
            self.latency_sum += seconds
            self.latency_max = max(self.latency_max, seconds)

    def take(self) -> dict[str, float]:
        with self._lock:
            mean = self.latency_sum / self.latency_count if self.latency_count else 0.0
            metrics = {"calls": float(self.calls), "retries": float(self.retries), "failures": float(self.failures),
                       "latency_mean_s": mean, "latency_max_s": self.latency_max}
            self._zero()
        return metrics


def load_environment(spec: str, params: Mapping[str, Any] | None = None) -> Callable[[], Environment]:
    """A factory of the environment class named by `spec` (`package.module:Class`), `params` bound as constructor
    keyword arguments. Every problem (malformed spec, module not importable, missing attribute, not a class, no
    callable `reset` / `step`, params the constructor does not accept) is a one-line `ValueError` raised here,
    before any episode."""
    params = dict(params or {})
    cls = _resolve(spec)
    check_params(spec, "environment", cls, params, call=f"{cls.__name__}(**params)")
    return functools.partial(cls, **params) if params else cls


def _resolve(spec: str) -> type:
    cls = import_spec(spec, "environment", "Class")
    attr_path = spec.partition(":")[2]
    if not inspect.isclass(cls):
        raise ValueError(f"environment {spec!r}: {attr_path!r} is a {type(cls).__name__}, not a class with "
                         "reset(prompt, label) and step(action)")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"environment {spec!r}: class {attr_path!r} has no method {method}(); an environment has "
                             "reset(prompt, label) -> str and step(action) -> StepResult (docs/environments.md)")
    return cls


def _checked_step_result(value: Any) -> StepResult:
    """`value` if it is a `StepResult` of the right types (a finite reward becomes a float), else raise `TypeError`
    saying what is wrong. The reference service runs environments through `InProcessEnvironments`, so a remote
    environment is held to the same rules."""
    if not isinstance(value, StepResult):
        raise TypeError(f"step returned {type(value).__name__}, not a StepResult (rewards.environments.interface)")
    if not isinstance(value.observation, str):
        raise TypeError(f"StepResult.observation is a {type(value.observation).__name__}, not a str")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"StepResult.reward {reward!r} is not a finite number")
    if not isinstance(value.done, bool):
        raise TypeError(f"StepResult.done is a {type(value.done).__name__}, not a bool (use bool(...))")
    if not isinstance(value.info, dict):
        raise TypeError(f"StepResult.info is a {type(value.info).__name__}, not a dict")
    try:  # as the service will send it: strict JSON, no NaN
        json.dumps(value.info, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"StepResult.info is not JSON-able ({error})") from None
    return StepResult(value.observation, float(reward), value.done, value.info)


class _AllStuck(Exception):
    """Every slot is held by a call that ran past its deadline."""


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    woken: bool = False


class _Slots:
    """At most `size` environment calls in threads at once: the bound of `InProcessEnvironments`.

    A slot is taken before a call starts and freed when its thread returns, not when its caller stops waiting, so
    the thread pool never queues. `take` raises `_AllStuck` instead of waiting when every slot is held by a call past
    its deadline. Thread-safe, and callers may run on different event loops: slots are freed by worker threads.
    """

    def __init__(self, size: int):
        self.size, self.busy, self.stuck = size, 0, 0
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    async def take(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self.stuck >= self.size:
                    raise _AllStuck
                if self.busy < self.size:
                    self.busy += 1
                    return
                waiter = _Waiter(loop, loop.create_future())
                self._waiters.append(waiter)
            try:
                await waiter.future
            except asyncio.CancelledError:
                with self._lock:
                    if waiter.woken:
                        self._wake_one()  # hand on the wake-up this caller will not use
                    else:
                        self._waiters.remove(waiter)
                raise

    def free(self, stuck: bool) -> None:
        with self._lock:
            self.busy -= 1
            self.stuck -= stuck
            self._wake_one()

    def mark_stuck(self) -> None:
        with self._lock:
            self.stuck += 1
            while self.stuck >= self.size and self._waiters:  # each wakes to raise _AllStuck
                self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.woken = True
            try:
                waiter.loop.call_soon_threadsafe(_set_none, waiter.future)
                return
            except RuntimeError:  # its loop is closed: nobody waits there any more; wake the next one
                continue


def _set_none(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _Running:
    """One call in a worker thread: frees its slot when it returns, as stuck if its caller gave up on it first."""

    def __init__(self, slots: _Slots):
        self._slots = slots
        self._lock = threading.Lock()
        self._returned = self._stuck = False

    def returned(self, _: Future) -> None:  # the future's done callback, in the worker thread
        with self._lock:
            self._returned = True
            stuck = self._stuck
        self._slots.free(stuck)

    def give_up(self) -> bool:
        """Count the call as stuck; False if it has returned meanwhile (then its result stands)."""
        with self._lock:
            if self._returned:
                return False
            self._stuck = True
            self._slots.mark_stuck()  # under our lock, so `returned` cannot free the slot before it is counted
            return True


class InProcessEnvironments:
    """Episode sessions on environments of this process, each call in a pool of `max_concurrency` threads.

    Usage, in a coroutine (any event loop; several loops may share one instance):
        environments = InProcessEnvironments(load_environment("mypkg.envs:Shell", {"root": "/tmp"}))
        session = environments.open()
        observation = await session.reset(prompt, label)
        result = await session.step(action)      # until result.done
        await session.close()
    factory: makes one environment per episode (in a worker thread, with its `reset`). timeout: seconds one call may
    run (None: no limit). name: for messages (default: the factory's class name).

    Decisions:
    - The loop runs many episodes at once (`asyncio.gather` over G x prompts sessions). Environments are plain
      synchronous classes, so every call (constructor + `reset`, `step`, `close`) runs in a pool of
      `max_concurrency` threads: a slow environment holds one thread, never the event loop or the other episodes.
      Each call has a deadline (`timeout`) counted from the moment its thread starts it.
    - Python cannot stop a thread: a call past its deadline raises `EpisodeError` for its caller but keeps its thread
      and its slot until it returns. Once every slot is held like that, calls fail at once instead of waiting.
    - A session refuses to be used wrongly (step before reset, after `done`, after a failed call, two calls at once)
      with `RuntimeError`: those are the caller's bugs. What the environment does wrong (raises, returns something
      that is not a `StepResult` of the right types, runs past the deadline) is an `EpisodeError`, to which the loop
      applies the run's failure policy.
    - `close` never raises `EpisodeError`: a failed close is logged and counted, and ends nothing else.
    """

    def __init__(self, factory: Callable[[], Environment], *, max_concurrency: int = 8, timeout: float | None = 30.0,
                 name: str | None = None):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1 (got {max_concurrency})")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive or None (got {timeout})")
        self.factory, self.max_concurrency, self.timeout = factory, max_concurrency, timeout
        self.name = name or getattr(getattr(factory, "func", factory), "__name__", "environment")
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="relay-env")
        self._slots = _Slots(max_concurrency)
        self._stats = CallStats()
        self._closed = False

    def __repr__(self) -> str:
        return (f"InProcessEnvironments(name={self.name!r}, max_concurrency={self.max_concurrency}, "
                f"timeout={self.timeout})")

    def __enter__(self) -> InProcessEnvironments:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> EpisodeSession:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        return _InProcessSession(self)

    def take_metrics(self) -> dict[str, float]:
        return self._stats.take()

    def close(self) -> None:
        """Stop the thread pool (calls still running finish in their threads); idempotent."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, session: _InProcessSession, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a worker thread within the deadline; `EpisodeError` if it raises or runs past it."""
        label = f"environment {self.name!r}: {what}"
        self._stats.add(calls=1)
        try:
            await self._slots.take()
        except _AllStuck:
            self._stats.add(failures=1)
            raise EpisodeError(f"{label}: all {self.max_concurrency} threads are held by calls that ran past timeout="
                               f"{self.timeout:g}s; the environment hangs: give it its own time limit") from None
        running = _Running(self._slots)
        try:
            future = self._pool.submit(_timed, fn, *args)
        except BaseException:
            self._slots.free(False)
            raise
        future.add_done_callback(running.returned)
        session._running = future
        try:
            value, seconds = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except TimeoutError:
            if running.give_up():
                self._stats.add(failures=1)
                raise EpisodeError(f"{label} took longer than timeout={self.timeout:g}s (its thread runs on until it "
                                   "returns: Python cannot stop it)") from None
            value, seconds = self._result(label, future)  # it returned just as the deadline passed
        except Exception as err:
            self._stats.add(failures=1)
            raise EpisodeError(f"{label} raised {type(err).__name__}: {_first_line(err)}") from err
        self._stats.latency(seconds)
        return value

    def _result(self, label: str, future: Future) -> tuple[Any, float]:
        try:
            return future.result()
        except Exception as err:
            self._stats.add(failures=1)
            raise EpisodeError(f"{label} raised {type(err).__name__}: {_first_line(err)}") from err


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else "(no message)"


class _InProcessSession:
    """One episode on one environment object of `InProcessEnvironments`."""

    def __init__(self, owner: InProcessEnvironments):
        self._owner = owner
        self._env: Environment | None = None  # set in the worker thread, as soon as it is constructed
        self._turn = 0
        self._reset = self._done = self._failed = self._busy = self._closed = False
        self._running: Future | None = None  # the last call's thread future

    async def reset(self, prompt: str, label: Any) -> str:
        if self._reset:
            raise RuntimeError("reset called twice on one session: open a new session per episode")
        self._reset = True
        return await self._call("reset", self._start, prompt, label)

    async def step(self, action: str) -> StepResult:
        if not self._reset:
            raise RuntimeError("step before reset")
        if self._done:
            raise RuntimeError(f"step after the episode is done (turn {self._turn - 1} returned done=True)")
        result = await self._call(f"step {self._turn}", self._step, action)
        self._turn += 1
        self._done = result.done
        return result

    async def close(self) -> None:
        """Close the environment (its `close()`, if it has one) once; never raises `EpisodeError`. After
        `InProcessEnvironments.close()` it does nothing: its threads are gone."""
        if self._busy:
            raise RuntimeError("close while another call of this session runs: await that call first")
        if self._closed or self._owner._closed:
            self._closed = True
            return
        self._closed = True
        running = self._running
        if running is not None and not running.done():  # a call past its deadline still holds the environment
            running.add_done_callback(lambda _: self._close_now())
            return
        if self._env is None or not callable(getattr(self._env, "close", None)):
            return
        try:
            await self._owner._call(self, "close", self._env.close)
        except EpisodeError as err:
            log.warning("%s", err, exc_info=err.__cause__)

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"{what} on a closed session")
        if self._failed:
            raise RuntimeError(f"{what} on a session whose environment failed earlier: close it")
        if self._busy:
            raise RuntimeError(f"{what} while another call of this session runs: calls on a session are sequential")
        self._busy = True
        try:
            return await self._owner._call(self, what, fn, *args)
        except BaseException:  # failed or abandoned (cancelled): the environment's state is unknown
            self._failed = True
            raise
        finally:
            self._busy = False

    def _start(self, prompt: str, label: Any) -> str:  # worker thread
        self._env = self._owner.factory()
        observation = self._env.reset(prompt, label)
        if not isinstance(observation, str):
            raise TypeError(f"reset returned {type(observation).__name__}, not a str")
        return observation

    def _step(self, action: str) -> StepResult:  # worker thread
        return _checked_step_result(self._env.step(action))

    def _close_now(self) -> None:  # in the worker thread of a call that has just returned
        close = getattr(self._env, "close", None)
        if not callable(close):
            return
        try:
            close()
        except Exception:  # logged with its traceback; the session is gone, nobody else to tell
            log.exception("environment %r: close raised", self._owner.name)
