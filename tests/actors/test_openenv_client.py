"""relay's OpenEnv client (rewards/environments/openenv_client.py) against servers made by openenv-core's own
`create_app`, on loopback: episodes equal the in-process ones (the reset carries the prompt and label), the field
mapping and null rewards, sessions bounded by `max_concurrency`, and each fault a clear one-line counted failure
that is not retried blindly: capacity reached (retried: sessions end), an environment that raises, an action of the
wrong shape, malformed replies, a dead server, a step past its deadline, a connection lost mid-episode, a refused token.

Servers run with uvicorn on a background thread (`run_in_thread`); the environments are tests/openenv_envs.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket

import pytest
from fastapi import FastAPI
from openenv.core.env_server.http_server import create_app

from actors.episodes import open_environments
from rewards.config import EnvironmentConfig
from rewards.environments import examples
from rewards.environments.interface import METRIC_KEYS, InProcessEnvironments, StepResult
from rewards.environments.openenv_client import OpenEnvEnvironments
from rewards.environments.remote import RemoteEnvironmentError, RemoteEnvironments
from rewards.service import run_in_thread
from tests.envs import play_episode
from tests.openenv_envs import Calculator, Shell, ShellAction, ShellObservation, TextAction, TextObservation

TOKEN = "tok-51f0c2-secret"
# label -> the model's turns: a tool call then the answer; a wrong direct answer; an invalid call; too many calls
EPISODES = {1776: ["[37*48]", "1776"], 391: ["400"], 1225: ["[35*35", "[35*35]", "1225"], 99: ["[9*11]"] * 4}


def client(urls: list[str], **overrides) -> OpenEnvEnvironments:
    options = dict(timeout=2.0, max_retries=3, backoff=0.01, backoff_max=0.04, max_concurrency=8, name="calc")
    return OpenEnvEnvironments(urls, **{**options, **overrides})


def shell_server(max_concurrent_envs: int = 8):
    Shell.forget()
    return run_in_thread(create_app(Shell, ShellAction, ShellObservation, max_concurrent_envs=max_concurrent_envs))


def shell(urls: list[str], **overrides) -> OpenEnvEnvironments:
    return client(urls, action_field="command", observation_field="output", **overrides)


async def play(environments, label, actions: list[str]) -> list:
    """[initial observation, StepResult, ...] of one episode, stopping at done; the session is closed."""
    return await play_episode(environments, f"{label}?", label, actions)


def play_all(environments, episodes: dict) -> list[list]:
    async def everything():
        return await asyncio.gather(*(play(environments, label, actions) for label, actions in episodes.items()))

    return asyncio.run(everything())


def failure(environments, label, actions: list[str]) -> RemoteEnvironmentError:
    """The one-line error that fails the episode (fail if it does not)."""
    with pytest.raises(RemoteEnvironmentError) as raised:
        asyncio.run(play(environments, label, actions))
    assert "\n" not in str(raised.value)
    return raised.value


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def ws(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


@pytest.fixture(scope="module")
def calculator_url():
    with run_in_thread(create_app(Calculator, TextAction, TextObservation, max_concurrent_envs=8)) as url:
        yield url


def test_episodes_on_openenvs_server_equal_the_in_process_ones(calculator_url):
    Calculator.resets.clear()
    with client([calculator_url]) as environments:
        episodes = play_all(environments, EPISODES)
        again = play_all(environments, EPISODES)  # another event loop: the client's own loop carries on
        metrics = environments.take_metrics()
    with InProcessEnvironments(lambda: examples.Calculator(2)) as in_process:
        assert episodes == again == play_all(in_process, EPISODES)
    assert episodes[0] == ["", StepResult("1776 ", 0.0, False, {"tool_call": True}), StepResult("", 1.0, True)]
    assert episodes[2][1] == StepResult("error ", 0.0, False, {"invalid_call": True})
    assert episodes[3][-1] == StepResult("", 0.0, True, {"too_many_calls": True})
    # OpenEnv handed each reset's data to Calculator.reset(prompt=..., label=...), the label's JSON type kept.
    assert sorted(Calculator.resets) == sorted([(f"{label}?", label) for label in EPISODES] * 2)
    steps = sum(len(episode) - 1 for episode in episodes)
    assert set(metrics) == set(METRIC_KEYS)
    assert metrics["calls"] == 2 * (4 + steps + 4) and metrics["retries"] == 0 and metrics["failures"] == 0
    assert 0 < metrics["latency_mean_s"] <= metrics["latency_max_s"] < 2.0


def test_the_fields_map_text_both_ways_and_a_null_reward_is_zero():
    with shell_server() as url, shell([url]) as environments:
        [episode] = play_all(environments, {0: ["ls -l", "exit", "never sent"]})
    # Shell's observations are {"output": ..., "exit_code": 0} with reward null until `exit` (1.0, done).
    assert episode == ["$ ", StepResult("ran: ls -l", 0.0, False), StepResult("bye", 1.0, True)]
    assert Shell.steps == ["ls -l", "exit"]


def test_sessions_open_at_once_stay_within_max_concurrency():
    # The server holds 2 environments; the client's 2 slots are held for each session's life, so 6 concurrent
    # episodes never open a third connection (which would get CAPACITY_REACHED) and run 2 at a time.
    with shell_server(max_concurrent_envs=2) as url, shell([url], max_concurrency=2) as environments:
        episodes = play_all(environments, {n: ["ls", "exit"] for n in range(6)})
        metrics = environments.take_metrics()
    assert all(episode[-1] == StepResult("bye", 1.0, True) for episode in episodes)
    assert Shell.most == 2 and metrics["failures"] == 0 and metrics["retries"] == 0


def test_capacity_reached_is_retried_then_a_counted_failure():  # tests/actors/test_openenv_capacity.py: it frees
    with shell_server(max_concurrent_envs=1) as url, shell([url], max_concurrency=2) as environments:
        async def two_sessions():
            first = environments.open()
            await first.reset("a", 0)
            second = environments.open()
            try:
                with pytest.raises(RemoteEnvironmentError) as raised:
                    await second.reset("b", 1)
                return raised.value, await first.step("exit")  # the first session is unharmed
            finally:
                await second.close()
                await first.close()

        error, result = asyncio.run(two_sessions())
        metrics = environments.take_metrics()
    assert str(error) == (f"environment 'calc' at {ws(url)}: reset failed: 3 retries exhausted: the server answered "
                          "error CAPACITY_REACHED: Server at capacity: 1/1 sessions active. Cannot accept new "
                          "connections. (the server's max_concurrent_envs is reached: keep env.max_concurrency times "
                          "the rollout workers within it, or raise it)")
    assert result == StepResult("bye", 1.0, True)
    assert metrics["failures"] == 1 and metrics["retries"] == 3 and Shell.most == 1


def test_an_environment_that_raises_fails_its_step_which_is_sent_once():
    with shell_server() as url, shell([url]) as environments:
        error = failure(environments, 0, ["ls", "boom", "ls"])
        metrics = environments.take_metrics()
    assert str(error) == (f"environment 'calc' at {ws(url)}: step 1 failed: the server answered error "
                          "EXECUTION_ERROR: boom: no such command second line (the environment raised)")
    assert error.call == "step 1" and Shell.steps == ["ls", "boom"]
    assert metrics["failures"] == 1 and metrics["retries"] == 0


def test_an_action_of_the_wrong_shape_names_the_action_field():
    with shell_server() as url, client([url], observation_field="output") as environments:  # {"message": ...}
        error = failure(environments, 0, ["ls"])
    assert str(error) == (f"environment 'calc' at {ws(url)}: step 0 failed: the server answered error "
                          "VALIDATION_ERROR: Invalid message: command: Field required; message: Extra inputs are not "
                          "permitted (an action is {'message': text}: check env.action_field)")
    assert Shell.steps == []


class Rewrite:
    """ASGI wrapper around a real OpenEnv app: each text frame it sends is `rewrite(json)` (a str: sent as it is)."""

    def __init__(self, app, rewrite):
        self.app, self.rewrite = app, rewrite

    async def __call__(self, scope, receive, send):
        async def rewritten(message):
            if message["type"] == "websocket.send" and message.get("text"):
                out = self.rewrite(json.loads(message["text"]))
                message = {**message, "text": out if isinstance(out, str) else json.dumps(out)}
            await send(message)

        await self.app(scope, receive, rewritten if scope["type"] == "websocket" else send)


def with_data(**changes):
    return lambda reply: {**reply, "data": {**reply["data"], **changes}}


# (case, rewrite of the server's replies, observation_field, message)
MALFORMED = [
    ("no text field", lambda reply: reply, "text",
     "the observation has no text field 'text' (its fields: exit_code, output); set env.observation_field"),
    ("text not a string", lambda reply: reply, "exit_code",
     "the observation has no text field 'exit_code' (its fields: exit_code, output); set env.observation_field"),
    ("not json", lambda reply: "<html>", "output", "not JSON"),
    ("reward a string", with_data(reward="1"), "output", 'reward "1" is not a finite number or null'),
    ("done missing", with_data(done=None), "output", "done null is not true or false"),
    ("another type", lambda reply: {**reply, "type": "state"}, "output",
     'expected {"type": "observation", "data": {"observation": {...}, ...}}, got {"type": "state", "data": '
     '{"observation": {"output": "$ ", "exit_code": 0}, "rew'),  # the reply quoted, cut at 80 characters
]


@pytest.mark.parametrize("case, rewrite, field, message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_a_malformed_reply_fails_at_once(case, rewrite, field, message):
    app = Rewrite(create_app(Shell, ShellAction, ShellObservation, max_concurrent_envs=8), rewrite)
    with run_in_thread(app) as url, client([url], action_field="command", observation_field=field) as environments:
        error = failure(environments, 0, ["ls"])
        metrics = environments.take_metrics()
    assert str(error) == f"environment 'calc' at {ws(url)}: reset failed: malformed reply: {message}"
    assert metrics["failures"] == 1 and metrics["retries"] == 0


def test_a_dead_server_is_retried_then_fails_and_a_live_one_takes_the_retry(calculator_url):
    dead = closed_port_url()
    with client([dead]) as environments:
        error = failure(environments, 1776, ["1776"])
        metrics = environments.take_metrics()
    assert str(error) == f"environment 'calc' at {ws(dead)}: reset failed: 3 retries exhausted: connection refused"
    assert metrics["failures"] == 1 and metrics["retries"] == 3 and metrics["calls"] == 1
    with client([dead, calculator_url]) as environments:  # sessions 0 and 2 try the dead one first
        episodes = play_all(environments, {1776: ["1776"], 391: ["391"], 99: ["99"]})
        metrics = environments.take_metrics()
    assert episodes == [["", StepResult("", 1.0, True)]] * 3
    assert metrics["retries"] == 2 and metrics["failures"] == 0


def test_a_step_past_its_deadline_fails_and_is_not_sent_again():
    with shell_server() as url, shell([url], timeout=1.0) as environments:
        error = failure(environments, 0, ["slow", "ls"])
        metrics = environments.take_metrics()
        Shell.release.set()
    assert str(error) == (f"environment 'calc' at {ws(url)}: step 0 failed: no reply within timeout=1s; not retried "
                          "(the step may have been applied)")
    assert Shell.steps == ["slow"] and metrics["failures"] == 1 and metrics["retries"] == 0


def test_a_connection_lost_mid_episode_fails_the_episode():
    with contextlib.ExitStack() as server, shell([url := server.enter_context(shell_server())]) as environments:
        async def episode():
            session = environments.open()
            try:
                assert await session.reset("a", 0) == "$ "
                await asyncio.to_thread(server.close)  # the server goes away
                with pytest.raises(RemoteEnvironmentError) as raised:
                    await session.step("ls")
                return raised.value
            finally:
                await session.close()

        error = asyncio.run(episode())
        metrics = environments.take_metrics()
    assert str(error) == (f"environment 'calc' at {ws(url)}: step 0 failed: the connection was lost; not retried "
                          "(the step may have been applied)")
    assert Shell.steps == [] and metrics["failures"] == 1 and metrics["retries"] == 0


class RequireToken:
    """ASGI wrapper: a WebSocket handshake without `Authorization: Bearer TOKEN` is refused (HTTP 403)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and (b"authorization", f"Bearer {TOKEN}".encode()) not in scope["headers"]:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.app(scope, receive, send)


def test_the_token_goes_on_the_handshake_and_never_into_a_message(calculator_url, monkeypatch):
    app = RequireToken(create_app(Calculator, TextAction, TextObservation, max_concurrent_envs=8))
    with run_in_thread(app) as url:
        monkeypatch.setenv("ENV_TOKEN", TOKEN)
        with client([url], token_env="ENV_TOKEN") as environments:
            assert play_all(environments, {1776: ["1776"]}) == [["", StepResult("", 1.0, True)]]
            assert TOKEN not in repr(environments)
        monkeypatch.setenv("ENV_TOKEN", "tok-wrong")
        with client([url], token_env="ENV_TOKEN") as environments:
            error = failure(environments, 1776, ["1776"])
            metrics = environments.take_metrics()
        with client([url]) as environments:
            unauthenticated = failure(environments, 1776, ["1776"])
    assert str(error) == (f"environment 'calc' at {ws(url)}: reset failed: HTTP 403 on the WebSocket handshake, not "
                          "retried (check the token in $ENV_TOKEN, and that the server is OpenEnv's)")
    assert metrics["retries"] == 0 and metrics["failures"] == 1
    assert str(unauthenticated).endswith("not retried (the server wants a bearer token: set env.token_env; or it is "
                                         "not an OpenEnv server)")


def test_a_server_without_openenvs_websocket_is_named():
    with run_in_thread(FastAPI()) as url, client([url]) as environments:
        error = failure(environments, 0, ["x"])
        metrics = environments.take_metrics()
    assert str(error).endswith("reset failed: HTTP 403 on the WebSocket handshake, not retried (the server wants a "
                               "bearer token: set env.token_env; or it is not an OpenEnv server)")
    assert metrics["retries"] == 0


def test_the_protocol_chooses_the_client_and_bad_settings_are_one_line_errors():
    openenv = open_environments(EnvironmentConfig(urls=["http://127.0.0.1:9"], protocol="openenv",
                                                  action_field="command", observation_field="output", timeout=5))
    relay = open_environments(EnvironmentConfig(urls=["http://127.0.0.1:9"]))
    try:
        assert isinstance(openenv, OpenEnvEnvironments) and isinstance(relay, RemoteEnvironments)
        assert (openenv.action_field, openenv.observation_field, openenv.timeout) == ("command", "output", 5)
    finally:
        openenv.close()
        relay.close()
    for settings, message in [
        (dict(spec="rewards.environments.examples:Calculator", protocol="openenv"),
         "protocol 'openenv' talks to OpenEnv servers: set urls (e.g. env.urls=[http://127.0.0.1:8000]) instead of "
         "spec"),
        (dict(urls=["http://127.0.0.1:9"], action_field="command"),
         "action_field maps text to and from an OpenEnv server's dicts: set protocol=openenv (and urls), or remove "
         "action_field"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            EnvironmentConfig(**settings)
