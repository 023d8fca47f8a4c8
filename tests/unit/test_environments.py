"""The environment interface: `load_environment`'s errors, the example environment, and `InProcessEnvironments`
(calls in threads within its bound, a slow environment holding up nobody else, deadlines, what an environment may
return, sessions used wrongly, metrics).

Concurrency is asserted by who met whom (barriers, events), never by how long something took.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from rewards.environments.examples import GuessNumber
from rewards.environments.interface import (
    METRIC_KEYS,
    EpisodeError,
    InProcessEnvironments,
    StepResult,
    load_environment,
)
from tests.envs import play_episode

# ---------------------------------------------------------------- test environments (loaded by spec below)


class NoStep:
    def reset(self, prompt, label):
        return ""


class NeedsRoot:
    def __init__(self, root: str, depth: int = 1):
        self.root = root

    def reset(self, prompt, label):
        return ""

    def step(self, action):
        return StepResult("")


class Echo:
    """Answers each action with its upper-case text; done at the action `stop`. Records the thread of each call."""

    threads: list[int] = []

    def reset(self, prompt, label):
        Echo.threads.append(threading.get_ident())
        return f"<{prompt}>"

    def step(self, action):
        Echo.threads.append(threading.get_ident())
        return StepResult(action.upper(), reward=float(len(action)), done=action == "stop", info={"n": len(action)})


class Returns:
    """An environment whose step returns whatever it is given, and whose reset returns `reset_value`."""

    def __init__(self, value=None, reset_value=""):
        self.value, self.reset_value = value, reset_value

    def reset(self, prompt, label):
        return self.reset_value

    def step(self, action):
        return self.value


class Raises:
    def reset(self, prompt, label):
        return ""

    def step(self, action):
        raise ZeroDivisionError(f"cannot step on {action!r}\nsecond line")


class Blocking:
    """Steps on action `block` wait for `release` (set by the test); `returned` is set when such a step returns and
    `closed` when close() is called."""

    def __init__(self, release: threading.Event, returned: threading.Event, closed: threading.Event):
        self.release, self.returned, self.closed = release, returned, closed

    def reset(self, prompt, label):
        return ""

    def step(self, action):
        if action == "block":
            assert self.release.wait(30)
            self.returned.set()
        return StepResult(action)

    def close(self):
        self.closed.set()


SPEC = f"{__name__}"


# ---------------------------------------------------------------- load_environment


@pytest.mark.parametrize("spec, params, message", [
    ("rewards.environments.examples", None, "environment 'rewards.environments.examples' is not of the form "
                                            "'package.module:Class'"),
    ("no_such_package.envs:Env", None, "cannot import module 'no_such_package.envs' (No module named "
                                       "'no_such_package'); check the name and that it is on PYTHONPATH"),
    ("rewards.environments.examples:Nope", None, "module 'rewards.environments.examples' has no attribute 'Nope'"),
    ("rewards.environments.examples:_INTEGER", None, "'_INTEGER' is a Pattern, not a class with reset(prompt, "
                                                     "label) and step(action)"),
    (f"{SPEC}:NoStep", None, "class 'NoStep' has no method step(); an environment has reset(prompt, label) -> str "
                             "and step(action) -> StepResult"),
    ("rewards.environments.examples:GuessNumber", {"turns": 3}, "does not accept parameter 'turns'; its parameters "
                                                               "are (max_turns)"),
    (f"{SPEC}:NeedsRoot", {"depth": 2}, "cannot be called as NeedsRoot(**params): missing a required argument: "
                                        "'root'; its parameters are (root, depth)"),
], ids=["no colon", "no module", "no attribute", "not a class", "no step", "unknown param", "missing param"])
def test_load_environment_errors_are_one_line(spec, params, message):
    with pytest.raises(ValueError) as raised:
        load_environment(spec, params)
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_load_environment_binds_params():
    factory = load_environment("rewards.environments.examples:GuessNumber", {"max_turns": 2})
    first, second = factory(), factory()
    assert isinstance(first, GuessNumber) and first.max_turns == 2 and first is not second  # one per episode
    assert load_environment("rewards.environments.examples:GuessNumber", None) is GuessNumber


def test_guess_number_episode():
    env = GuessNumber(max_turns=3)
    assert env.reset("guess", "7") == ""
    assert env.step("5") == StepResult("higher")
    assert env.step("nothing") == StepResult("no number", info={"invalid_call": True})
    assert env.step("I say 3 then 9") == StepResult("lower", done=True)  # the last integer; max_turns reached
    env.reset("guess", 7)
    assert env.step("-1, 7") == StepResult("correct", reward=1.0, done=True)


# ---------------------------------------------------------------- InProcessEnvironments


def run(coro):
    return asyncio.run(coro)


async def episode(environments, prompt, actions):
    """[initial observation, StepResult, ...], stopping at done; the session closed."""
    return await play_episode(environments, prompt, None, actions)


def test_sessions_run_in_worker_threads_and_metrics_count_calls():
    Echo.threads.clear()
    with InProcessEnvironments(Echo, max_concurrency=2) as environments:
        async def both():
            return await asyncio.gather(episode(environments, "a", ["hi", "stop", "never"]),
                                        episode(environments, "b", ["x"]))

        first, second = run(both())
        metrics = environments.take_metrics()
        again = environments.take_metrics()
    assert first == ["<a>", StepResult("HI", 2.0, False, {"n": 2}), StepResult("STOP", 4.0, True, {"n": 4})]
    assert second == ["<b>", StepResult("X", 1.0, False, {"n": 1})]
    assert len(Echo.threads) == 5 and threading.get_ident() not in Echo.threads  # never on the event loop's thread
    assert set(metrics) == set(METRIC_KEYS)
    assert metrics["calls"] == 5 and metrics["failures"] == 0 and metrics["retries"] == 0  # Echo has no close()
    assert 0 < metrics["latency_mean_s"] <= metrics["latency_max_s"]
    assert again == dict.fromkeys(METRIC_KEYS, 0.0)  # taken: reset


def test_at_most_max_concurrency_calls_run_at_once():
    barrier = threading.Barrier(3, timeout=30)
    lock, running, peak = threading.Lock(), [0], [0]

    class Crowded:
        def reset(self, prompt, label):
            return ""

        def step(self, action):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            barrier.wait()  # three calls must be in their threads together, or this breaks
            with lock:
                running[0] -= 1
            return StepResult("")

    with InProcessEnvironments(Crowded, max_concurrency=3) as environments:
        async def many():
            return await asyncio.gather(*(episode(environments, str(i), ["go"]) for i in range(6)))

        results = run(many())
    assert len(results) == 6 and not barrier.broken
    assert peak[0] == 3  # the barrier needs 3 at once; the bound allows no 4th


def test_a_slow_environment_holds_up_no_other_episode():
    release, returned, closed = threading.Event(), threading.Event(), threading.Event()
    with InProcessEnvironments(lambda: Blocking(release, returned, closed), max_concurrency=4) as environments:
        async def scenario():
            slow = asyncio.create_task(episode(environments, "slow", ["block"]))
            fast = await asyncio.gather(*(episode(environments, str(i), ["a", "b"]) for i in range(6)))
            still_blocked = not slow.done()  # six episodes finished while the slow one waits in its thread
            release.set()
            return fast, still_blocked, await slow

        fast, still_blocked, slow = run(scenario())
    assert still_blocked and fast == [["", StepResult("a"), StepResult("b")]] * 6
    assert slow == ["", StepResult("block")] and closed.is_set()


def test_a_call_past_its_deadline_fails_and_keeps_its_slot_until_it_returns():
    release, returned, closed = threading.Event(), threading.Event(), threading.Event()
    environments = InProcessEnvironments(lambda: Blocking(release, returned, closed), max_concurrency=1, timeout=0.2)

    async def scenario():
        session = environments.open()
        await session.reset("", None)
        with pytest.raises(EpisodeError) as timed_out:
            await session.step("block")
        with pytest.raises(RuntimeError, match="failed earlier: close it"):
            await session.step("again")
        await session.close()  # the environment is closed once the stuck step returns, not under it
        closed_early = closed.is_set()
        with pytest.raises(EpisodeError) as all_stuck:  # the only slot is held: fail now, not wait for ever
            await environments.open().reset("", None)
        release.set()
        for _ in range(500):  # the slot is freed when the thread returns
            try:
                return timed_out.value, closed_early, all_stuck.value, await episode(environments, "", ["ok"])
            except EpisodeError:
                await asyncio.sleep(0.01)
        raise AssertionError("the slot was never freed")

    try:
        timed_out, closed_early, all_stuck, after = run(scenario())
    finally:
        release.set()
        environments.close()
    assert str(timed_out) == ("environment '<lambda>': step 0 took longer than timeout=0.2s (its thread runs on until "
                              "it returns: Python cannot stop it)")
    assert str(all_stuck) == ("environment '<lambda>': reset: all 1 threads are held by calls that ran past "
                              "timeout=0.2s; the environment hangs: give it its own time limit")
    assert not closed_early and returned.is_set() and closed.wait(10)
    assert after == ["", StepResult("ok")]


def test_cancelled_waiters_do_not_lose_the_slot():
    release, returned, closed = threading.Event(), threading.Event(), threading.Event()
    with InProcessEnvironments(lambda: Blocking(release, returned, closed), max_concurrency=1) as environments:
        async def scenario():
            holder = asyncio.create_task(episode(environments, "", ["block"]))
            while not environments._slots.busy:  # the holder has the only slot
                await asyncio.sleep(0.01)
            cancelled = asyncio.create_task(episode(environments, "", ["x"]))
            waiting = asyncio.create_task(episode(environments, "", ["y"]))
            await asyncio.sleep(0.05)
            cancelled.cancel()
            release.set()
            return await holder, await waiting, cancelled.cancelled()

        holder, waiting, was_cancelled = run(scenario())
    assert holder == ["", StepResult("block")] and waiting == ["", StepResult("y")] and was_cancelled


def test_an_environment_that_raises_is_an_episode_error():
    with InProcessEnvironments(Raises, name="raiser") as environments:
        with pytest.raises(EpisodeError) as raised:
            run(episode(environments, "", ["go"]))
        metrics = environments.take_metrics()
    assert str(raised.value) == "environment 'raiser': step 0 raised ZeroDivisionError: cannot step on 'go'"
    assert isinstance(raised.value.__cause__, ZeroDivisionError)  # the traceback is kept
    assert metrics["failures"] == 1 and metrics["calls"] == 2


@pytest.mark.parametrize("value, message", [
    (("obs", 1.0, True, {}), "step returned tuple, not a StepResult"),
    (StepResult(3), "StepResult.observation is a int, not a str"),
    (StepResult("", reward=float("nan")), "StepResult.reward nan is not a finite number"),
    (StepResult("", reward="1"), "StepResult.reward '1' is not a finite number"),
    (StepResult("", reward=True), "StepResult.reward True is not a finite number"),
    (StepResult("", done=1), "StepResult.done is a int, not a bool"),
    (StepResult("", info=[1]), "StepResult.info is a list, not a dict"),
    (StepResult("", info={"x": object()}), "StepResult.info is not JSON-able"),
    (StepResult("", info={"x": float("inf")}), "StepResult.info is not JSON-able"),
], ids=["tuple", "observation", "nan", "string reward", "bool reward", "done", "info list", "info object",
        "info inf"])
def test_a_step_result_of_the_wrong_types_is_an_episode_error(value, message):
    with InProcessEnvironments(lambda: Returns(value)) as environments, pytest.raises(EpisodeError) as raised:
        run(episode(environments, "", ["go"]))
    assert f"step 0 raised TypeError: {message}" in str(raised.value), str(raised.value)


def test_an_integer_reward_becomes_a_float_and_reset_must_return_text():
    with InProcessEnvironments(lambda: Returns(StepResult("", reward=2))) as environments:
        (_, result) = run(episode(environments, "", ["go"]))
    assert result.reward == 2.0 and type(result.reward) is float
    with InProcessEnvironments(lambda: Returns(reset_value=None)) as environments, pytest.raises(EpisodeError) as e:
        run(episode(environments, "", []))
    assert "reset raised TypeError: reset returned NoneType, not a str" in str(e.value)


def test_a_session_used_wrongly_raises_runtime_error():
    with InProcessEnvironments(Echo) as environments:
        async def misuse():
            session = environments.open()
            with pytest.raises(RuntimeError, match="step before reset"):
                await session.step("x")
            await session.reset("", None)
            with pytest.raises(RuntimeError, match="reset called twice"):
                await session.reset("", None)
            first = asyncio.create_task(session.step("a"))
            await asyncio.sleep(0)  # it has started
            with pytest.raises(RuntimeError, match="calls on a session are sequential"):
                await session.step("b")
            with pytest.raises(RuntimeError, match="close while another call of this session runs"):
                await session.close()
            assert (await first).observation == "A"
            await session.step("stop")
            with pytest.raises(RuntimeError, match=r"step after the episode is done \(turn 1 returned done=True\)"):
                await session.step("x")
            await session.close()
            await session.close()  # idempotent
            other = environments.open()
            await other.reset("", None)
            await other.close()
            with pytest.raises(RuntimeError, match="step 0 on a closed session"):
                await other.step("x")

        run(misuse())


def test_in_process_environments_checks_its_arguments():
    with pytest.raises(ValueError, match="max_concurrency must be at least 1"):
        InProcessEnvironments(Echo, max_concurrency=0)
    with pytest.raises(ValueError, match="timeout must be positive or None"):
        InProcessEnvironments(Echo, timeout=0)
