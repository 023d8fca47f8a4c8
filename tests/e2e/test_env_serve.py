"""`relay env serve` as a user runs it: episodes over HTTP with a token equal the in-process ones (and the API's
description, `/openapi.json`, `/docs`, `/redoc`, needs the token as the API does), the address it
binds (loopback unless --host says otherwise, read from the listening socket) with the warning when it serves
beyond loopback without a token, and one-line errors with exit code 2 for a bad environment or option."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from rewards.environments.examples import GuessNumber
from rewards.environments.interface import InProcessEnvironments, StepResult
from rewards.environments.remote import RemoteEnvironments

ROOT = Path(__file__).resolve().parents[2]
SPEC = "rewards.environments.examples:GuessNumber"
TOKEN = "t0k3n-for-env-test"
EPISODES = {4: ["2", "6", "4"], 9: ["1", "2", "3"], 7: ["seven", "7"]}  # target -> actions


async def play_all(environments) -> list[list]:
    async def play(target: int, actions: list[str]) -> list:
        session = environments.open()
        out = [await session.reset(f"guess {target}", target)]
        for action in actions:
            out.append(await session.step(action))
            if out[-1].done:
                break
        await session.close()
        return out

    return await asyncio.gather(*(play(t, a) for t, a in EPISODES.items()))


def test_serve_runs_episodes_with_a_token(serve_env, monkeypatch):
    _, url = serve_env(["--env", SPEC, "--param", "max_turns=2", "--token-env", "SERVE_TOKEN", "--workers", "2"],
                       {"SERVE_TOKEN": TOKEN})
    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    with RemoteEnvironments([url], token_env="ENV_TOKEN", timeout=10) as environments:
        episodes = asyncio.run(play_all(environments))
    with InProcessEnvironments(lambda: GuessNumber(max_turns=2)) as environments:
        expected = asyncio.run(play_all(environments))
    unauthorized = httpx.post(f"{url}/reset", json={"prompt": "", "label": 1})
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    docs = {path: (httpx.get(f"{url}{path}").status_code, httpx.get(f"{url}{path}", headers=bearer).status_code)
            for path in ("/openapi.json", "/docs", "/redoc")}  # the API's description is behind the token too
    assert episodes == expected
    assert episodes[2] == ["", StepResult("no number", info={"invalid_call": True}), StepResult("correct", 1.0, True)]
    assert episodes[1][-1] == StepResult("higher", done=True)  # max_turns=2 reached
    assert unauthorized.status_code == 401
    assert docs == {"/openapi.json": (401, 200), "/docs": (401, 200), "/redoc": (401, 200)}


@pytest.mark.parametrize("args, bound, warns", [
    ([], "127.0.0.1", False),  # the default: loopback only
    (["--host", "0.0.0.0"], "0.0.0.0", True),  # every interface, no token: anyone who can reach it can use it
], ids=["default", "all-interfaces"])
def test_serve_binds_where_asked_and_warns_when_open(serve_env, args, bound, warns):
    process, url = serve_env(["--env", SPEC, *args])
    port = int(url.rsplit(":", 1)[1])
    listening = [c.laddr.ip for c in psutil.Process(process.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    assert listening == [bound], stderr
    warning = "serving on 0.0.0.0 without a token: anyone who can reach it can use it; set a token (relay env serve " \
              "--token-env VAR) or bind 127.0.0.1"
    assert (warning in stderr) == warns, stderr


@pytest.mark.parametrize("args, message", [
    (["--env", "no_such_module:Env"], "environment 'no_such_module:Env': cannot import module 'no_such_module' (No "
                                      "module named 'no_such_module'); check the name and that it is on PYTHONPATH"),
    (["--env", SPEC, "--param", "turns=2"], f"environment '{SPEC}' does not accept parameter 'turns'; its parameters "
                                            "are (max_turns)"),
    ([], "give --env package.module:Class (e.g. --env rewards.environments.examples:GuessNumber)"),
], ids=["bad module", "bad param", "no env"])
def test_a_bad_environment_exits_2_with_one_line(args, message):
    script = Path(sys.executable).parent / "relay"
    relay = [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]
    done = subprocess.run([*relay, "env", "serve", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and done.stderr == f"relay: config error: {message}\n"
