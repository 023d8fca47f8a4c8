"""`relay env serve` to OpenEnv's own software (openenv-core, never our copy of its protocol): `openenv validate --url`
passes every criterion; OpenEnv's `GenericEnvClient` plays episodes, each client in its own session; capacity, bad
messages and bad actions get the error replies OpenEnv's own server gives (both servers asked the same thing); a
WebSocket or request without the token is refused; `/mcp` lists a tool environment's tools; the stateless HTTP
`/reset` and `/step` answer OpenEnv's shapes beside relay's own protocol on the same paths."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from openenv.core.env_server.http_server import create_app as openenv_create_app
from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
from openenv.core.env_server.mcp_types import JsonRpcResponse
from openenv.core.env_server.types import (
    Action,
    Observation,
    ResetResponse,
    State,
    StepResponse,
    WSErrorResponse,
    WSObservationResponse,
)
from openenv.core.generic_client import GenericEnvClient
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from rewards.environments.examples import GuessNumber
from rewards.environments.service import create_app
from rewards.environments.sessions import ENVIRONMENT_FAILED
from rewards.environments.tools import ToolEnvironment
from rewards.service import run_in_thread

SPEC = "rewards.environments.examples:GuessNumber"
TOKEN = "t0k3n-for-openenv-test"
CRITERIA = {"openapi_version_available", "health_endpoint", "metadata_endpoint", "schema_endpoint", "mcp_endpoint",
            "mode_endpoint_consistency"}


class Message(Action):
    message: str


class Text(Observation):
    text: str = ""


class Echo(OpenEnvEnvironment[Message, Text, State]):
    """An environment on OpenEnv's own server, to ask both servers the same thing: answers each message with it."""

    def reset(self, **kwargs: Any) -> Text:
        return Text()

    def step(self, action: Message, **kwargs: Any) -> Text:
        return Text(text=action.message)

    @property
    def state(self) -> State:
        return State()


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


def ask(ws, message: Any) -> dict:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=10))


def observed(result) -> tuple:
    return result.observation, result.reward, result.done


@contextmanager
def both_servers(max_sessions: int = 8):
    """relay's service of `GuessNumber` and OpenEnv's own of `Echo`, in this process: (relay URL, OpenEnv URL)."""
    theirs = openenv_create_app(Echo, Message, Text, max_concurrent_envs=1 if max_sessions == 1 else None)
    with run_in_thread(create_app(GuessNumber, max_sessions=max_sessions)) as ours, run_in_thread(theirs) as url:
        yield ours, url


def test_openenv_validate_passes_and_its_client_plays_an_episode(serve_env):
    _, url = serve_env(["--env", SPEC, "--param", "max_turns=3"])
    openenv = Path(sys.executable).parent / "openenv"
    done = subprocess.run([str(openenv), "validate", "--url", url], capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    with GenericEnvClient(base_url=url).sync() as env:
        episode = [observed(env.reset(prompt="Guess my number.", label=6, episode_id="e1"))]
        episode += [observed(env.step({"message": action})) for action in ("I guess 4", "nine", "6")]
        state = env.state()
    assert done.returncode == 0 and report["passed"], done.stdout + done.stderr
    assert {c["id"] for c in report["criteria"] if c["passed"]} == CRITERIA and report["mode"] == "simulation"
    assert episode == [({"text": "", "info": {}}, None, False),
                       ({"text": "higher", "info": {}}, 0.0, False),
                       ({"text": "no number", "info": {"invalid_call": True}}, 0.0, False),
                       ({"text": "correct", "info": {}}, 1.0, True)]
    assert state == {"episode_id": "e1", "step_count": 3}


def test_concurrent_clients_each_get_their_own_session():
    with run_in_thread(create_app(partial(GuessNumber, max_turns=2))) as url:
        with GenericEnvClient(base_url=url).sync() as first, GenericEnvClient(base_url=url).sync() as second:
            first.reset(label=3)
            second.reset(label=8)
            turns = [observed(client.step({"message": "5"})) for client in (first, second)]
            turns += [observed(client.step({"message": "7"})) for client in (first, second)]
            again = observed(first.reset(label=7))  # a new episode on the same connection, on a new environment
            turns.append(observed(first.step({"message": "7"})))
            states = first.state(), second.state()
    assert turns == [({"text": "lower", "info": {}}, 0.0, False), ({"text": "higher", "info": {}}, 0.0, False),
                     ({"text": "lower", "info": {}}, 0.0, True), ({"text": "higher", "info": {}}, 0.0, True),
                     ({"text": "correct", "info": {}}, 1.0, True)]  # max_turns=2 ended both first episodes
    assert again == ({"text": "", "info": {}}, None, False)
    assert [state["step_count"] for state in states] == [1, 2]


def test_capacity_is_answered_as_openenv_answers_it():
    replies = []
    with both_servers(max_sessions=1) as urls:
        for url in urls:
            with connect(ws_url(url)) as holder:
                ask(holder, {"type": "reset", "data": {"label": 1}})
                with connect(ws_url(url)) as refused:
                    replies.append(json.loads(refused.recv(timeout=10)))
                    with pytest.raises(ConnectionClosed):
                        refused.recv(timeout=10)  # closed after the error, as OpenEnv's server does
    ours = create_app(GuessNumber, max_sessions=1)
    with run_in_thread(ours) as url:
        with GenericEnvClient(base_url=url).sync() as holder:
            holder.reset(label=1)
        for _ in range(500):  # the holder's close reaches the service and frees its slot
            if not ours.state.sessions.open:
                break
            time.sleep(0.01)
        with GenericEnvClient(base_url=url).sync() as client:
            freed = observed(client.reset(label=1))
    relay, openenv = (WSErrorResponse.model_validate(reply).data for reply in replies)
    assert relay["code"] == openenv["code"] == "CAPACITY_REACHED"
    assert (relay["active_sessions"], relay["max_sessions"]) == (openenv["active_sessions"], openenv["max_sessions"])
    assert relay["message"] == "max_sessions=1 sessions are open; retry later"
    assert freed == ({"text": "", "info": {}}, None, False)


@pytest.mark.parametrize("message", [
    {"type": "step", "data": {"msg": "5"}},  # not the action's field
    {"type": "step", "data": {"message": 5}},  # not text
    {"type": "step"},  # no action
    {"type": "state", "data": {}},  # a field the message does not have
    {"type": "jump"},
    "{not json",
], ids=["wrong field", "not text", "no action", "extra field", "unknown type", "not json"])
def test_bad_messages_get_openenv_errors_and_the_session_goes_on(message):
    replies = []
    with both_servers() as urls:
        for url in urls:
            with connect(ws_url(url)) as ws:
                ask(ws, {"type": "reset", "data": {"label": 7}})
                replies.append(ask(ws, message))
                replies.append(ask(ws, {"type": "step", "data": {"message": "7"}}))
    relay, openenv, relay_after, openenv_after = replies[0], replies[2], replies[1], replies[3]
    assert WSErrorResponse.model_validate(relay).data["code"] == openenv["data"]["code"]
    assert relay["data"]["message"] == openenv["data"]["message"]
    assert WSObservationResponse.model_validate(relay_after).data == {
        "observation": {"text": "correct", "info": {}}, "reward": 1.0, "done": True}
    assert openenv_after["type"] == "observation"


def test_a_step_refused_by_the_episode_is_an_execution_error():
    with run_in_thread(create_app(GuessNumber)) as url, connect(ws_url(url)) as ws:
        early = ask(ws, {"type": "step", "data": {"message": "1"}})
        ask(ws, {"type": "reset", "data": {"label": 1}})
        ask(ws, {"type": "step", "data": {"message": "1"}})
        late = ask(ws, {"type": "step", "data": {"message": "1"}})
        broken = ask(ws, {"type": "reset", "data": {"label": "one"}})  # GuessNumber's int("one") raises
    assert early["data"] == {"message": "step before reset: send a reset first", "code": "EXECUTION_ERROR"}
    assert late["data"] == {"message": "the episode is done: reset to start a new episode", "code": "EXECUTION_ERROR"}
    assert broken["data"] == {"message": ENVIRONMENT_FAILED, "code": "EXECUTION_ERROR"}  # its text: in the log


def test_without_the_token_websocket_and_routes_are_refused():
    with run_in_thread(create_app(GuessNumber, token=TOKEN)) as url:
        with pytest.raises(ConnectionError) as refused, GenericEnvClient(base_url=url).sync() as env:
            env.reset(label=1)
        with pytest.raises(InvalidStatus) as wrong:
            connect(ws_url(url), additional_headers={"Authorization": "Bearer wrong"})
        with connect(ws_url(url), additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            ask(ws, {"type": "reset", "data": {"label": 2}})
            played = ask(ws, {"type": "step", "data": {"message": "2"}})
        gets = {path: httpx.get(f"{url}{path}").status_code for path in ("/state", "/schema", "/metadata")}
        posts = {path: httpx.post(f"{url}{path}", json=body).status_code for path, body in
                 (("/mcp", {}), ("/reset", {}), ("/step", {"action": {"message": "2"}}))}
        health = httpx.get(f"{url}/health")
    assert "HTTP 403" in str(refused.value) and wrong.value.response.status_code == 403
    assert played["data"]["reward"] == 1.0
    assert gets == {"/state": 401, "/schema": 401, "/metadata": 401}
    assert posts == {"/mcp": 401, "/reset": 401, "/step": 401}
    assert health.json() == {"status": "healthy"}


def test_mcp_lists_a_tool_environments_tools_as_openenv_answers():
    tools = partial(ToolEnvironment, tools="rewards.environments.tools:calculate")
    rpc = {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}
    with run_in_thread(create_app(tools)) as url, both_servers() as (plain, openenv):
        listed = httpx.post(f"{url}/mcp", json=rpc, timeout=60).json()  # the first imports transformers
        with connect(ws_url(url)) as ws:
            over_ws = ask(ws, {"type": "mcp", "data": rpc})
        none = httpx.post(f"{plain}/mcp", json=rpc).json()
        json_body = {"content-type": "application/json"}  # relay's services refuse a body not declared JSON (415)
        ours, theirs = ({body: httpx.post(f"{base}/mcp", content=body, headers=json_body).json()["error"]["code"]
                         for body in ("{}", "{not json", '{"jsonrpc": "2.0", "method": "nope", "id": 2}')}
                        for base in (plain, openenv))
    assert JsonRpcResponse.model_validate(listed).result == {"tools": [{
        "name": "calculate",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "inputSchema": {"type": "object", "required": ["expression"], "properties": {"expression": {
            "type": "string", "description": 'The expression, for example "2 * (3 + 4) / 7".'}}}}]}
    assert over_ws == {"type": "mcp", "data": listed}
    assert none == {"jsonrpc": "2.0", "id": 1, "result": {"tools": []}}
    assert ours == theirs


def test_stateless_http_beside_relays_protocol():
    app = create_app(GuessNumber)
    with run_in_thread(app) as url:
        reset = httpx.post(f"{url}/reset", json={"episode_id": "e1", "prompt": "Guess.", "label": 3})
        step = httpx.post(f"{url}/step", json={"action": {"message": "3"}, "label": 3})
        bad = httpx.post(f"{url}/step", json={"action": {"msg": "3"}})
        relay = httpx.post(f"{url}/reset", json={"prompt": "Guess.", "label": 3})
        relay_invalid = httpx.post(f"{url}/reset", json={"label": 3})  # relay's: prompt is required
        open_after = set(app.state.sessions.open)
    assert ResetResponse.model_validate(reset.json()).observation == {"text": "", "info": {}}
    assert StepResponse.model_validate(step.json()).model_dump() == {
        "observation": {"text": "correct", "info": {}}, "reward": 1.0, "done": True}
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["message"]
    assert relay.json().keys() == {"session_id", "observation"} and relay_invalid.status_code == 422
    assert open_after == {relay.json()["session_id"]}  # the stateless calls' environments were closed
