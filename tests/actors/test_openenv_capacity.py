"""relay's OpenEnv client (rewards/environments/openenv_client.py) at the documented sizing, `env.max_concurrency` x
rollout workers = the server's `max_concurrent_envs`, against openenv-core's own server: a step past its deadline
fails its episode, and the next episode on that slot waits for the server to free the late step's environment
instead of finding it held (`CAPACITY_REACHED`); a session refused for capacity is retried with backoff, and succeeds
once the server has room."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rewards.environments.interface import StepResult
from rewards.environments.remote import RemoteEnvironmentError
from tests.actors.test_openenv_client import shell, shell_server, ws
from tests.openenv_envs import Shell


def test_the_slot_of_a_late_step_waits_for_the_server_to_free_its_environment():
    with shell_server(max_concurrent_envs=1) as url, shell([url], max_concurrency=1, timeout=1.0) as environments:
        async def two_episodes():
            late = environments.open()
            await late.reset("a", 0)
            with pytest.raises(RemoteEnvironmentError) as raised:
                await late.step("slow")  # the server goes on running it after the client gave up
            await late.close()
            # The step finishes a while after; only then does OpenEnv's server close its environment.
            threading.Timer(0.5, Shell.release.set).start()
            after = environments.open()
            try:
                return raised.value, [await after.reset("b", 1), await after.step("exit")]
            finally:
                await after.close()

        error, episode = asyncio.run(two_episodes())
        metrics = environments.take_metrics()
    assert str(error) == (f"environment 'calc' at {ws(url)}: step 0 failed: no reply within timeout=1s; not retried "
                          "(the step may have been applied)")
    assert episode == ["$ ", StepResult("bye", 1.0, True)]
    assert metrics["failures"] == 1 and Shell.most == 1 and Shell.steps == ["slow", "exit"]


def test_a_session_refused_for_capacity_is_retried_until_the_server_has_room():
    with shell_server(max_concurrent_envs=1) as url, \
            shell([url], max_concurrency=2, max_retries=50, backoff=0.05, backoff_max=0.1) as environments:
        async def two_sessions():
            first = environments.open()
            await first.reset("a", 0)
            second = environments.open()
            waiting = asyncio.create_task(second.reset("b", 1))
            await asyncio.sleep(0.3)  # the second is refused for capacity meanwhile: 50 retries span ~2.5 s
            assert await first.step("exit") == StepResult("bye", 1.0, True)
            await first.close()
            try:
                return [await waiting, await second.step("exit")]
            finally:
                await second.close()

        episode = asyncio.run(two_sessions())
        metrics = environments.take_metrics()
    assert episode == ["$ ", StepResult("bye", 1.0, True)]
    assert metrics["failures"] == 0 and metrics["retries"] >= 1 and Shell.most == 1
