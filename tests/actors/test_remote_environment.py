"""The remote environment client (rewards/environments/remote.py) against the real reference service
(rewards/environments/service.py) on loopback: episodes equal the in-process ones, sessions stick to their replica,
every fault the protocol names (lost replies, malformed replies, 5xx, 4xx, full service, deadlines, expiry),
idempotent steps, and the bearer token.

Services run with uvicorn on a background thread (`run_in_thread`). Clients use small timeouts and backoffs so the
file runs in seconds; waits are for events (a call returned, a session was closed), with generous bounds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rewards.environments.examples import GuessNumber
from rewards.environments.interface import METRIC_KEYS, InProcessEnvironments, StepResult
from rewards.environments.remote import RemoteEnvironmentError, RemoteEnvironments
from rewards.environments.service import create_app
from rewards.service import run_in_thread
from tests.envs import play_episode

TOKEN = "tok-9d2e7b-secret"
GUESSES = {3: ["5", "2", "3"], 8: ["5", "9", "x", "8"], 1: ["7", "7", "7", "7", "7"]}  # target -> actions


def client(urls: list[str], **overrides) -> RemoteEnvironments:
    """A client with quick timeouts: 3 retries within ~0.1 s of backoff."""
    options = dict(timeout=2.0, max_retries=3, backoff=0.01, backoff_max=0.04, max_concurrency=8, name="guess")
    return RemoteEnvironments(urls, **{**options, **overrides})


async def play(environments, target: int, actions: list[str]) -> list:
    """[initial observation, StepResult, ...] of one episode, stopping at done; the session is closed."""
    return await play_episode(environments, f"guess {target}", target, actions)


def play_all(environments) -> list[list]:
    async def all_episodes():
        return await asyncio.gather(*(play(environments, t, a) for t, a in GUESSES.items()))

    return asyncio.run(all_episodes())


def counting(steps: list[str], max_turns: int = 4):
    """A GuessNumber class recording every action it is stepped with into `steps`."""
    class Counted(GuessNumber):
        def __init__(self):
            super().__init__(max_turns)

        def step(self, action):
            steps.append(action)
            return super().step(action)

    return Counted


def expected_episodes() -> list[list]:
    with InProcessEnvironments(lambda: GuessNumber(4)) as environments:
        return play_all(environments)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def raise_from(coro_fn):
    """Run `coro_fn()`; return the RemoteEnvironmentError it raises (fail if it does not)."""
    with pytest.raises(RemoteEnvironmentError) as raised:
        asyncio.run(coro_fn())
    return raised.value


class Intercept:
    """ASGI wrapper: the first `n` requests to `path` are handled by `fault` instead of reaching `app` straight:
    `"status:503"` answers that status without `app` seeing it; `"lost"` lets `app` handle the request (so it is
    applied) and answers 502 instead of its reply; `"late"` sends `app`'s reply only once a request with the same
    body (the client's retry, sent when its timeout ran out) has been answered, so the reply is late however slow
    the machine is."""

    def __init__(self, app, path: str, fault: str, n: int = 1):
        self.app, self.path, self.fault, self.left, self.hit = app, path, fault, n, 0
        self.late: dict[bytes, asyncio.Event] = {}  # body of a held reply -> set when its retry was answered

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        body = bytearray()

        async def reading():
            message = await receive()
            body.extend(message.get("body", b""))
            return message

        if self.left <= 0:
            await self.app(scope, reading, send)
            if bytes(body) in self.late:
                self.late[bytes(body)].set()
            return
        self.left -= 1
        self.hit += 1
        if self.fault.startswith("status:"):
            await JSONResponse({"detail": "injected fault"}, int(self.fault[7:]))(scope, receive, send)
            return
        held: list[dict] = []

        async def hold(message):
            held.append(message)

        await self.app(scope, reading, hold)
        if self.fault == "lost":
            await JSONResponse({"detail": "bad gateway"}, status_code=502)(scope, receive, send)
            return
        retried = self.late.setdefault(bytes(body), asyncio.Event())
        try:
            await asyncio.wait_for(retried.wait(), 30)
        except TimeoutError:
            pass  # no retry came: the reply arrives late all the same, and the test's retry count fails
        for message in held:
            await send(message)


def fake_service(step_reply) -> FastAPI:
    """A service whose /reset opens session "s" and whose /step answers `step_reply()`: a Response or a JSON body."""
    app = FastAPI()
    app.state.steps = 0

    @app.post("/reset")
    async def reset(request: Request):
        return {"session_id": "s", "observation": ""}

    @app.post("/step")
    async def step(request: Request):
        app.state.steps += 1
        out = step_reply(request)
        return out if isinstance(out, Response) else JSONResponse(out)

    @app.post("/close")
    async def close():
        return {}

    return app


async def one_step(environments, action: str = "5") -> StepResult:
    session = environments.open()
    await session.reset("guess", 3)
    return await session.step(action)


@pytest.fixture(scope="module")
def service_url():
    with run_in_thread(create_app(lambda: GuessNumber(4))) as url:
        yield url


def test_episodes_over_http_equal_the_in_process_ones(service_url):
    with client([service_url]) as environments:
        episodes = play_all(environments)
        again = play_all(environments)  # another event loop: the client's own loop carries on
        metrics = environments.take_metrics()
    assert episodes == again == expected_episodes()
    assert episodes[0][1:] == [StepResult("lower"), StepResult("higher"), StepResult("correct", 1.0, True)]
    assert episodes[1][3] == StepResult("no number", info={"invalid_call": True})
    steps = sum(len(e) - 1 for e in episodes)
    assert set(metrics) == set(METRIC_KEYS)
    assert metrics["calls"] == 2 * (3 + steps + 3) and metrics["retries"] == 0 and metrics["failures"] == 0
    assert 0 < metrics["latency_mean_s"] <= metrics["latency_max_s"] < 2.0


def test_new_sessions_go_round_robin_and_each_sticks_to_its_replica():
    resets = {"a": 0, "b": 0}
    steps = {"a": [], "b": []}

    def replica(name):
        class Replica(counting(steps[name])):
            def reset(self, prompt, label):
                resets[name] += 1
                return super().reset(prompt, label)
        return Replica

    with run_in_thread(create_app(replica("a"))) as url_a, run_in_thread(create_app(replica("b"))) as url_b:
        with client([url_a, url_b]) as environments:
            episodes = play_all(environments) + play_all(environments)
    # A step sent to the other replica would get 404 (unknown session) and fail the episode.
    assert episodes == expected_episodes() * 2
    assert resets == {"a": 3, "b": 3} and len(steps["a"]) + len(steps["b"]) == sum(len(e) - 1 for e in episodes)


def test_a_dead_replica_costs_a_reset_one_retry(service_url):
    with client([closed_port_url(), service_url]) as environments:
        episodes = play_all(environments)
        metrics = environments.take_metrics()
    assert episodes == expected_episodes()
    assert metrics["retries"] == 2 and metrics["failures"] == 0  # resets 0 and 2 tried the dead one first


def test_the_service_down_is_a_one_line_error():
    url = closed_port_url()
    with client([url]) as environments:
        error = raise_from(lambda: one_step(environments))
        metrics = environments.take_metrics()
    assert str(error) == f"environment 'guess' at {url}: reset failed: 3 retries exhausted: connection refused"
    assert error.url == url and error.call == "reset"
    assert metrics["failures"] == 1 and metrics["retries"] == 3 and metrics["calls"] == 1


@pytest.mark.parametrize("fault", ["lost", "late"])
def test_a_retried_step_whose_reply_was_lost_is_applied_once(fault):
    steps: list[str] = []
    app = Intercept(create_app(counting(steps)), "/step", fault)
    with run_in_thread(app) as url, client([url], timeout=1.0) as environments:
        episodes = play_all(environments)
        metrics = environments.take_metrics()
    assert app.hit == 1 and metrics["retries"] == 1 and metrics["failures"] == 0
    assert episodes == expected_episodes()
    assert len(steps) == sum(len(e) - 1 for e in episodes)  # every action applied exactly once


def test_5xx_is_retried_without_applying_the_step_twice():
    steps: list[str] = []
    app = Intercept(create_app(counting(steps)), "/step", "status:503", n=2)
    with run_in_thread(app) as url, client([url]) as environments:
        result = asyncio.run(one_step(environments))
        metrics = environments.take_metrics()
    assert result == StepResult("lower") and steps == ["5"]
    assert app.hit == 2 and metrics["retries"] == 2 and metrics["failures"] == 0


def test_5xx_forever_fails_after_the_retries():
    app = Intercept(create_app(lambda: GuessNumber()), "/step", "status:500", n=10**6)
    with run_in_thread(app) as url, client([url]) as environments:
        error = raise_from(lambda: one_step(environments))
    assert str(error) == (f"environment 'guess' at {url}: step 0 failed: 3 retries exhausted: HTTP 500: "
                          '{"detail":"injected fault"}')
    assert app.hit == 4 and error.call == "step 0"


# (case, reply to /step, message)
MALFORMED = [
    ("not json", lambda r: Response("<html>oops</html>", media_type="text/html"), "not JSON"),
    ("not an object", lambda r: [1, 2], 'expected {"observation": ..., "reward": ..., "done": ..., "info": ...}'),
    ("observation missing", lambda r: {"reward": 0.0, "done": False, "info": {}}, "observation null is not a string"),
    ("reward nan", lambda r: Response(json.dumps({"observation": "", "reward": float("nan"), "done": False}),
                                      media_type="application/json"), "reward NaN is not a finite number"),
    ("reward string", lambda r: {"observation": "", "reward": "1", "done": False}, 'reward "1" is not a finite number'),
    ("reward bool", lambda r: {"observation": "", "reward": True, "done": False}, "reward true is not a finite number"),
    ("done not bool", lambda r: {"observation": "", "reward": 0, "done": 1}, "done 1 is not true or false"),
    ("info a list", lambda r: {"observation": "", "reward": 0, "done": False, "info": []}, "info [] is not an object"),
]


@pytest.mark.parametrize("case, reply, message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_step_replies_are_retried_then_fail(case, reply, message):
    app = fake_service(reply)
    with run_in_thread(app) as url, client([url]) as environments:
        error = raise_from(lambda: one_step(environments))
        metrics = environments.take_metrics()
    assert str(error) == f"environment 'guess' at {url}: step 0 failed: 3 retries exhausted: malformed reply: {message}"
    assert app.state.steps == 4 and metrics["retries"] == 3 and metrics["failures"] == 1


def test_a_reply_without_info_is_an_empty_info():
    app = fake_service(lambda r: {"observation": "ok", "reward": 2, "done": True})
    with run_in_thread(app) as url, client([url]) as environments:
        result = asyncio.run(one_step(environments))
    assert result == StepResult("ok", 2.0, True, {}) and type(result.reward) is float


def test_4xx_is_not_retried():
    app = fake_service(lambda r: JSONResponse({"detail": "bad action"}, status_code=400))
    with run_in_thread(app) as url, client([url]) as environments:
        error = raise_from(lambda: one_step(environments))
    assert str(error) == (f"environment 'guess' at {url}: step 0 failed: HTTP 400, not retried: "
                          '{"detail":"bad action"}')
    assert app.state.steps == 1


def test_bearer_token_is_required_and_never_shown(monkeypatch):
    with run_in_thread(create_app(lambda: GuessNumber(4), token=TOKEN)) as url:
        with client([url]) as environments:
            missing = raise_from(lambda: one_step(environments))
        monkeypatch.setenv("ENV_TOKEN", "wrong-" + TOKEN)
        with client([url], token_env="ENV_TOKEN") as environments:
            wrong = raise_from(lambda: one_step(environments))
            wrong_metrics = environments.take_metrics()
        monkeypatch.setenv("ENV_TOKEN", TOKEN)
        with client([url], token_env="ENV_TOKEN") as environments:
            episodes = play_all(environments)
            shown = repr(environments) + json.dumps(environments.take_metrics())
        raw = {path: httpx.post(f"{url}{path}", json={}).status_code for path in ("/reset", "/step", "/close")}
        health = httpx.get(f"{url}/health")  # load balancers probe without a token
    assert "reset failed: HTTP 401, not retried (the service wants a bearer token: set token_env)" in str(missing)
    assert "HTTP 401, not retried (check the token in $ENV_TOKEN)" in str(wrong) and wrong_metrics["retries"] == 0
    assert TOKEN not in str(wrong) + repr(wrong) + str(missing)
    assert episodes == expected_episodes() and TOKEN not in shown and "ENV_TOKEN" in shown
    assert raw == {"/reset": 401, "/step": 401, "/close": 401} and health.json() == {"status": "healthy"}


def test_a_service_echoing_the_token_does_not_leak_it(monkeypatch, caplog):
    def echo(request):  # the token straddles the 200-character cut of the quoted reply
        return JSONResponse({"detail": "x" * 170 + request.headers["authorization"]}, status_code=503)

    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG, logger="rewards.environments.remote")
    with run_in_thread(fake_service(echo)) as url, client([url], token_env="ENV_TOKEN") as environments:
        error = raise_from(lambda: one_step(environments))
    shown = str(error) + "\n".join(r.getMessage() for r in caplog.records)
    assert "Bearer ***" in str(error)
    assert [TOKEN[:n] for n in range(4, len(TOKEN) + 1) if TOKEN[:n] in shown] == []


def test_the_service_keeps_turns_in_order(service_url):
    with httpx.Client(base_url=service_url) as http:
        session = http.post("/reset", json={"prompt": "guess", "label": 3, "metadata": {}}).json()
        sid = session["session_id"]
        early = http.post("/step", json={"session_id": sid, "action": "5", "turn": 1})
        first = http.post("/step", json={"session_id": sid, "action": "5", "turn": 0})
        repeated = http.post("/step", json={"session_id": sid, "action": "3", "turn": 0})  # a retry: same reply
        done = http.post("/step", json={"session_id": sid, "action": "3", "turn": 1})
        after_done = http.post("/step", json={"session_id": sid, "action": "3", "turn": 2})
        stale = http.post("/step", json={"session_id": sid, "action": "3", "turn": 0})
        unknown = http.post("/step", json={"session_id": "nope", "action": "3", "turn": 0})
        negative = http.post("/step", json={"session_id": sid, "action": "3", "turn": -1})
        no_prompt = http.post("/reset", json={"label": 3})
    assert session["observation"] == "" and len(sid) == 32
    assert early.status_code == 409 and "turn 1 is out of order: the session's next turn is 0" in early.text
    assert first.json() == repeated.json() == {"observation": "lower", "reward": 0.0, "done": False, "info": {}}
    assert done.json() == {"observation": "correct", "reward": 1.0, "done": True, "info": {}}
    assert after_done.status_code == 409 and "the episode is done" in after_done.text
    assert stale.status_code == 409 and "turn 0 is out of order: the session's next turn is 2" in stale.text
    assert unknown.status_code == 404 and "unknown session 'nope'" in unknown.text
    assert negative.status_code == 422 and no_prompt.status_code == 422
    assert [e["loc"] for e in no_prompt.json()["detail"]] == [["prompt"]]


def test_close_is_idempotent_and_ends_the_session(service_url):
    closed = threading.Event()

    class Closable(GuessNumber):
        def close(self):
            closed.set()

    async def close_twice(environments):
        session = environments.open()
        await session.reset("guess", 3)
        sid = session._session_id
        await session.close()
        await session.close()
        return sid

    with run_in_thread(create_app(Closable)) as url, client([url]) as environments:
        sid = asyncio.run(close_twice(environments))
        metrics = environments.take_metrics()
        step = httpx.post(f"{url}/step", json={"session_id": sid, "action": "3", "turn": 0})
        unknown = httpx.post(f"{url}/close", json={"session_id": "never-made"})
        assert closed.wait(10)
    assert metrics["calls"] == 2 and metrics["failures"] == 0  # reset and one close: the second sends nothing
    assert step.status_code == 404 and unknown.status_code == 200 and unknown.json() == {}


def test_an_idle_session_expires(caplog):
    closed = threading.Event()

    class Closable(GuessNumber):
        def close(self):
            closed.set()

    async def reset_then_wait(environments):
        session = environments.open()
        await session.reset("guess", 3)
        assert await asyncio.to_thread(closed.wait, 10)  # the service's sweep closed it
        return await session.step("3")

    with run_in_thread(create_app(Closable, session_ttl=0.2)) as url, client([url]) as environments:
        error = raise_from(lambda: reset_then_wait(environments))
    assert "step 0 failed: HTTP 404, not retried: " in str(error)
    assert "expired after session_ttl=0.2s idle" in str(error)


def test_a_full_service_answers_503_and_the_reset_is_retried_until_a_session_closes():
    app = create_app(lambda: GuessNumber(4), max_sessions=1)
    statuses: list[int] = []

    async def observed(scope, receive, send):  # record the status of every /reset reply
        async def record(message):
            if message["type"] == "http.response.start" and scope.get("path") == "/reset":
                statuses.append(message["status"])
            await send(message)
        await app(scope, receive, record)

    async def scenario(environments):
        first = environments.open()
        await first.reset("guess", 3)
        second = asyncio.create_task(play(environments, 8, ["8"]))
        while 503 not in statuses:  # the second reset was refused at least once
            await asyncio.sleep(0.01)
        await first.close()
        return await second

    with run_in_thread(observed) as url:
        direct = [httpx.post(f"{url}/reset", json={"prompt": "", "label": 1}) for _ in range(2)]
        httpx.post(f"{url}/close", json={"session_id": direct[0].json()["session_id"]})
        statuses.clear()
        with client([url], max_retries=100, backoff_max=0.05) as environments:
            episode = asyncio.run(scenario(environments))
            metrics = environments.take_metrics()
    assert direct[1].status_code == 503 and "max_sessions=1 sessions are open; retry later" in direct[1].text
    assert episode == ["", StepResult("correct", 1.0, True)]
    assert metrics["retries"] >= 1 and metrics["failures"] == 0


def test_a_step_past_step_timeout_is_504_and_its_retry_gets_the_late_reply():
    release, steps = threading.Event(), []

    class Slow(GuessNumber):
        def step(self, action):
            steps.append(action)
            assert release.wait(30)
            return super().step(action)

    with run_in_thread(create_app(Slow, step_timeout=0.2, workers=2)) as url, httpx.Client(base_url=url) as http:
        try:
            with client([url], max_retries=1) as environments:
                error = raise_from(lambda: one_step(environments))
            session = http.post("/reset", json={"prompt": "guess", "label": 3}).json()["session_id"]
            body = {"session_id": session, "action": "5", "turn": 0}
            first = http.post("/step", json=body)
            stalled = http.get("/health")
            next_turn = http.post("/step", json={**body, "turn": 1})
        finally:
            release.set()
        for _ in range(500):  # the same turn again: waits for the call that is still running, then its reply
            late = http.post("/step", json=body)
            if late.status_code != 504:
                break
        for _ in range(500):
            if http.get("/health").status_code == 200:
                break
            time.sleep(0.01)
        healthy = http.get("/health")
    assert str(error) == (f"environment 'guess' at {url}: step 0 failed: 1 retries exhausted: HTTP 504: "
                          '{"detail":"step 0 took longer than step_timeout=0.2s"}')
    assert first.status_code == 504 and next_turn.status_code == 409 and "turn 0 is still running" in next_turn.text
    assert stalled.status_code == 503
    assert stalled.json()["detail"] == "2 calls are past step_timeout=0.2s and unfinished (2 workers)"
    assert late.json() == {"observation": "lower", "reward": 0.0, "done": False, "info": {}}
    assert steps == ["5", "5"]  # one per session (the client's, then this one's): retries never applied it again
    assert healthy.status_code == 200


def test_a_reset_past_step_timeout_discards_its_session():
    release, closed = threading.Event(), threading.Event()

    class SlowStart(GuessNumber):
        def reset(self, prompt, label):
            assert release.wait(30)
            return super().reset(prompt, label)

        def close(self):
            closed.set()

    with run_in_thread(create_app(SlowStart, step_timeout=0.2)) as url:
        reply = httpx.post(f"{url}/reset", json={"prompt": "guess", "label": 3})
        closed_early = closed.is_set()
        release.set()
        assert closed.wait(10)  # closed once its reset returned
    assert reply.status_code == 504 and "reset took longer than step_timeout=0.2s" in reply.text and not closed_early


def test_an_environment_that_raises_gives_a_generic_500_and_the_detail_in_the_log(caplog):
    steps: list[str] = []

    class Broken(GuessNumber):
        def step(self, action):
            steps.append(action)
            raise ZeroDivisionError("/secret/path")

    caplog.set_level(logging.ERROR, logger="rewards.environments.service")
    with run_in_thread(create_app(Broken)) as url, client([url], max_retries=2) as environments:
        error = raise_from(lambda: one_step(environments))
    assert str(error) == (f"environment 'guess' at {url}: step 0 failed: HTTP 500, not retried: "
                          '{"detail":"the environment raised an exception or returned an invalid result; see the '
                          "service's log\",\"retryable\":false}")
    assert steps == ["5"]
    assert environments.take_metrics()["retries"] == 0  # the reply says a retry would get the same 500
    logged = [r for r in caplog.records if r.name == "rewards.environments.service"]
    assert len(logged) == 1 and "step 0 raised ZeroDivisionError: /secret/path" in logged[0].getMessage()
    assert logged[0].getMessage().startswith("session ") and logged[0].exc_info is not None


def test_client_arguments_are_checked_in_one_line(monkeypatch):
    monkeypatch.delenv("ENV_TOKEN", raising=False)
    cases = [
        (dict(urls=[]), "urls: give a list of at least one base URL"),
        (dict(urls="http://127.0.0.1:8000"), "urls: give a list of at least one base URL"),
        (dict(urls=["127.0.0.1:8000"]), "url '127.0.0.1:8000' is not of the form http(s)://host[:port]"),
        (dict(urls=["http://h:1"], backoff=2.0, backoff_max=1.0), "backoff (2.0) must not exceed backoff_max (1.0)"),
        (dict(urls=["http://h:1"], timeout=0), "timeout must be positive (got 0)"),
        (dict(urls=["http://h:1"], max_concurrency=0), "max_concurrency must be at least 1 (got 0)"),
        (dict(urls=["http://127.0.0.1:1"], token_env="ENV_TOKEN"), "token_env: environment variable ENV_TOKEN is "
                                                                  "unset"),
        (dict(urls=["http://h:1"], token_env="ENV_TOKEN"), "url http://h:1 is plain http to another machine"),
    ]
    for kwargs, message in cases:
        urls = kwargs.pop("urls")
        with pytest.raises(ValueError) as raised:
            RemoteEnvironments(urls, **kwargs)
        assert message in str(raised.value) and "\n" not in str(raised.value)
