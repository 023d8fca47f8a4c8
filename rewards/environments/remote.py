"""The client of the remote environment protocol (docs/environments.md): episodes on an environment service.

Owns: `RemoteEnvironments` (opens episode sessions on the service's replicas: new sessions round-robin, each
session sticks to the URL that created it; at most `max_concurrency` requests in flight; a deadline per request;
retries with full-jitter exponential backoff, and what is retried: its docstring; validation of every reply;
metrics), `RemoteEnvironmentError`, and what the OpenEnv client (rewards/environments/openenv_client.py) shares
with it: `LoopClient` (a client's life around its private loop), `LoopSession` and `check_arguments`.
Does not own: the failure policy (the episode loop, actors/episodes.py, marks the episode failed on
`RemoteEnvironmentError`; cluster/run/scoring.py stops the run or drops the group), nor the service side
(rewards/environments/service.py), nor the plumbing every client shares (rewards/http.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import httpx

from rewards.environments.interface import CallStats, EpisodeError, EpisodeSession, StepResult
from rewards.http import EventLoopThread, Redacting, RetriesFailed, Retryable, bearer_token, is_finite_number, retrying

log = logging.getLogger(__name__)

_URL = re.compile(r"https?://[^\s/:]+(:\d{1,5})?/?")
_TOKEN_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RemoteEnvironmentError(EpisodeError):
    """A call of an episode on an environment service failed after its retries; the message is one line naming the
    environment, the URL, the call (`reset`, `step N`, `close`) and the error, with the token scrubbed."""

    def __init__(self, message: str, url: str = "", call: str = ""):
        super().__init__(message)
        self.url, self.call = url, call


class LoopClient:
    """What relay's protocol's client and OpenEnv's (rewards/environments/openenv_client.py) share around their
    private loop: the context manager, `open` (refused once closed), `take_metrics`, running a coroutine on the loop
    (`_on_loop`) and the round-robin order of a new session's URLs (`_rotation`). A client sets `_closed`, `_stats`,
    `_loop`, `_urls` and `_next_url`, and defines `close` and `_new_session`."""

    _closed: bool
    _stats: CallStats
    _loop: EventLoopThread
    _urls: list[str]
    _next_url: int

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def open(self) -> EpisodeSession:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        return self._new_session()

    def _new_session(self) -> EpisodeSession:
        raise NotImplementedError

    def take_metrics(self) -> dict[str, float]:
        return self._stats.take()

    async def _on_loop(self, coro) -> Any:
        """Run `coro` on the private loop and await it from the caller's loop; cancelling the caller cancels it."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self!r} is closed")
        return await self._loop.call(coro)

    def _rotation(self) -> list[str]:
        """The URLs in the order a new session tries them (retries: the next ones): the next in turn first, round-robin
        over sessions. Called on the private loop only."""
        start = self._next_url
        self._next_url = (start + 1) % len(self._urls)
        return self._urls[start:] + self._urls[:start]


class RemoteEnvironments(LoopClient, Redacting):
    """Episode sessions on an environment service; the arguments mirror `RemoteSource` (rewards/config.py).

    Usage: `with RemoteEnvironments(["http://10.0.0.5:8000"]) as environments:`, then in a coroutine
    `session = environments.open(); await session.reset(prompt, label); await session.step(action); await
    session.close()`. urls: the replicas' base URLs. timeout: deadline of one request (seconds). max_retries,
    backoff, backoff_max: retries of one call, the first delay doubling up to backoff_max, full jitter.
    max_concurrency: requests in flight over all URLs. token_env: environment variable holding the bearer token.
    allow_plain_http_token: send it over plain http to a host that is not loopback anyway (else refused).

    Decisions:
    - As in rewards/remote.py, requests run on a private asyncio event loop in a daemon thread (`EventLoopThread`)
      with one `httpx.AsyncClient`, so connections are reused, each request gets a hard deadline (`asyncio.wait_for`:
      httpx's timeouts are per read), and sessions can be driven from any event loop (each call hops to the private
      one).
    - Retried: connection refused or reset, timeouts, 5xx (503: the service is full; 504: the call ran past its
      `step_timeout`) and malformed replies; not a 5xx whose JSON body says `"retryable": false` (the environment
      raised: the service keeps that reply for the turn, so a retry would only get it again). Retrying a step is
      safe because the request carries its `turn`: the service answers a repeated (session, turn) with its first
      reply, or waits for the first attempt's call, and never applies the action twice. Not retried: 4xx (401 token,
      404 unknown or expired session, 409 turn out of order, 413, 422), which the same request would get again.
    - A retried `reset` goes to the next URL (a dead replica costs one retry). It is not idempotent: a reset whose
      reply was lost leaves a session on the service that expires after its `session_ttl`.
    - `close` never raises `RemoteEnvironmentError`: a failed close is logged and counted; the service expires the
      session anyway.
    - The bearer token is read once, kept only in the client's default headers, and scrubbed from every message,
      whole before any cut; a URL that would carry it in clear text (plain http to another machine) is refused
      unless `allow_plain_http_token`.
    """

    def __init__(self, urls: Sequence[str], *, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.25,
                 backoff_max: float = 8.0, max_concurrency: int = 64, token_env: str | None = None,
                 verify_tls: bool = True, allow_plain_http_token: bool = False, name: str = "environment"):
        check_arguments(urls, timeout, max_retries, backoff, backoff_max, max_concurrency, token_env)
        self.name, self.timeout, self.max_retries = name, timeout, max_retries
        self.backoff, self.backoff_max, self.max_concurrency = backoff, backoff_max, max_concurrency
        self.token_env = token_env
        self._urls = [url.rstrip("/") for url in urls]
        headers = {"Accept": "application/json"}
        self._secret: str | None = bearer_token(token_env, urls, allow_plain_http_token)
        if self._secret:
            headers["Authorization"] = f"Bearer {self._secret}"
        self._stats = CallStats()
        self._next_url = 0  # round-robin position of the next new session; used on the private loop only
        self._closed = False
        self._loop = EventLoopThread(f"relay-env-{name}")
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._client: httpx.AsyncClient = self._loop.run(self._make_client(headers, limits, verify_tls), timeout=30)
        self._semaphore = asyncio.Semaphore(max_concurrency)

    async def _make_client(self, headers: dict[str, str], limits: httpx.Limits, verify: bool) -> httpx.AsyncClient:
        return httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(self.timeout), verify=verify,
                                 follow_redirects=False)

    def __repr__(self) -> str:
        return (f"RemoteEnvironments(name={self.name!r}, urls={self._urls!r}, "
                f"token={'<from $' + self.token_env + '>' if self.token_env else None})")

    @property
    def deadline_s(self) -> float:
        """Upper bound on one call's wall time (its attempts and backoffs), in seconds, not counting waits for a
        free request slot (each request in flight holds one for at most `timeout`)."""
        return (self.max_retries + 1) * self.timeout + self.max_retries * self.backoff_max

    def _new_session(self) -> EpisodeSession:
        return _RemoteSession(self)

    def close(self) -> None:
        """Cancel calls in flight (their callers get `CancelledError`), close the connections and stop the private
        event loop; idempotent. Sessions still open are left to expire on the service."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop(self._client.aclose)

    async def _reset(self, body: dict[str, Any]) -> tuple[tuple[str, str], str]:
        """POST /reset to the next URL in turn (retries: the URLs after it); ((session id, observation), URL)."""
        return await self._call("reset", "/reset", body, self._rotation(), self._read_reset)

    async def _call(self, what: str, path: str, body: dict[str, Any], urls: list[str],
                    read: Callable[[Any], Any]) -> tuple[Any, str]:
        """POST `body` to `path`, retrying transient faults (attempt k on urls[k % len(urls)]); (read(reply), URL)
        or `RemoteEnvironmentError`."""
        self._stats.add(calls=1)
        url = urls[0]

        async def attempt(k: int) -> Any:
            nonlocal url
            url = urls[k % len(urls)]
            async with self._semaphore:
                start = time.perf_counter()
                value = await asyncio.wait_for(self._post(url, path, body, read), timeout=self.timeout)
                self._stats.latency(time.perf_counter() - start)
            return value

        def retried(reason: str, delay: float) -> None:
            self._stats.add(retries=1)
            log.debug("environment '%s' at %s: %s: %s; retry in %.2fs", self.name, url, what, self._scrub(reason),
                      delay)

        try:
            value = await retrying(attempt, max_retries=self.max_retries, backoff=self.backoff,
                                   backoff_max=self.backoff_max, timeout=self.timeout, on_retry=retried)
        except RetriesFailed as err:
            self._stats.add(failures=1)
            message = self._scrub(f"environment '{self.name}' at {url}: {what} failed: {err}")
            log.warning("%s", message)
            raise RemoteEnvironmentError(message, url=url, call=what) from None
        return value, url

    async def _post(self, url: str, path: str, body: dict[str, Any], read: Callable[[Any], Any]) -> Any:
        return read(self._json_reply(await self._client.post(f"{url}{path}", json=body), self.token_env))

    def _read_reset(self, reply: Any) -> tuple[str, str]:
        if not isinstance(reply, dict):
            raise Retryable('malformed reply: expected {"session_id": ..., "observation": ...}')
        session_id, observation = reply.get("session_id"), reply.get("observation")
        if not isinstance(session_id, str) or not session_id:
            raise Retryable(f"malformed reply: session_id {self._quote(session_id)} is not a non-empty string")
        if not isinstance(observation, str):
            raise Retryable(f"malformed reply: observation {self._quote(observation)} is not a string")
        return session_id, observation

    def _read_step(self, reply: Any) -> StepResult:
        if not isinstance(reply, dict):
            raise Retryable('malformed reply: expected {"observation": ..., "reward": ..., "done": ..., "info": ...}')
        observation, reward, done = reply.get("observation"), reply.get("reward"), reply.get("done")
        info = reply.get("info", {})
        if not isinstance(observation, str):
            raise Retryable(f"malformed reply: observation {self._quote(observation)} is not a string")
        if not is_finite_number(reward):
            raise Retryable(f"malformed reply: reward {self._quote(reward)} is not a finite number")
        if not isinstance(done, bool):
            raise Retryable(f"malformed reply: done {self._quote(done)} is not true or false")
        if not isinstance(info, dict):
            raise Retryable(f"malformed reply: info {self._quote(info)} is not an object")
        return StepResult(observation, float(reward), done, info)


    def _quote(self, value: Any) -> str:
        return self._excerpt(json.dumps(value), 50)


class LoopSession:
    """An episode session of a client whose calls run on its private loop (`_owner._on_loop`): calls are sequential,
    and once one fails or is abandoned the session takes no other (the call may or may not have been applied).
    Shared by relay's protocol's sessions and OpenEnv's (rewards/environments/openenv_client.py)."""

    def __init__(self, owner: Any):
        self._owner = owner
        self._turn = 0
        self._done = self._failed = self._busy = self._closed = self._reset = False

    async def reset(self, prompt: str, label: Any) -> str:
        if self._reset:
            raise RuntimeError("reset called twice on one session: open a new session per episode")
        self._reset = True
        return await self._call("reset", self._send_reset(prompt, label))

    async def step(self, action: str) -> StepResult:
        if not self._reset:
            raise RuntimeError("step before reset")
        if self._done:
            raise RuntimeError(f"step after the episode is done (turn {self._turn - 1} returned done=True)")
        what = f"step {self._turn}"
        result = await self._call(what, self._send_step(what, action))
        self._turn += 1
        self._done = result.done
        return result

    async def close(self) -> None:
        """End the session on the server (idempotent); never raises `RemoteEnvironmentError`."""
        if self._busy:
            raise RuntimeError("close while another call of this session runs: await that call first")
        if self._closed:
            return
        self._closed = True
        if self._reset and not self._owner._closed:  # else nothing was opened, or the client dropped it already
            await self._end()

    async def _send_reset(self, prompt: str, label: Any) -> str:
        """On the private loop: open the session with its reset; the initial observation."""
        raise NotImplementedError

    async def _send_step(self, what: str, action: str) -> StepResult:
        """On the private loop: send one step and read its reply."""
        raise NotImplementedError

    async def _end(self) -> None:
        """End the session on the server (from the caller's loop); never raises `RemoteEnvironmentError`."""
        raise NotImplementedError

    async def _call(self, what: str, coro) -> Any:
        problem = ("on a closed session" if self._closed else
                   "on a session whose environment failed earlier: close it" if self._failed else
                   "while another call of this session runs: calls on a session are sequential" if self._busy
                   else None)
        if problem:
            coro.close()
            raise RuntimeError(f"{what} {problem}")
        self._busy = True
        try:
            return await self._owner._on_loop(coro)
        except BaseException:  # failed or abandoned (cancelled): the call may or may not have been applied
            self._failed = True
            raise
        finally:
            self._busy = False


class _RemoteSession(LoopSession):
    """One episode on the service: created by `reset` on one URL, which its steps and close then use."""

    def __init__(self, owner: RemoteEnvironments):
        super().__init__(owner)
        self._url = self._session_id = None

    async def _send_reset(self, prompt: str, label: Any) -> str:
        body = {"prompt": prompt, "label": label, "metadata": {}}
        (session_id, observation), self._url = await self._owner._reset(body)
        self._session_id = session_id
        return observation

    async def _send_step(self, what: str, action: str) -> StepResult:
        body = {"session_id": self._session_id, "action": action, "turn": self._turn}
        result, _ = await self._owner._call(what, "/step", body, [self._url], self._owner._read_step)
        return result

    async def _end(self) -> None:
        if self._session_id is None:  # never created: nothing to end
            return
        call = self._owner._call("close", "/close", {"session_id": self._session_id}, [self._url], _ignore)
        try:
            await self._owner._on_loop(call)
        except RemoteEnvironmentError:  # logged and counted by `_call`; the service expires the session anyway
            pass


def _ignore(reply: Any) -> None:
    return None


def check_arguments(urls: Sequence[str], timeout: float, max_retries: int, backoff: float, backoff_max: float,
                    max_concurrency: int, token_env: str | None) -> None:
    """One-line `ValueError`s for arguments `RemoteSource` would refuse (both environment clients')."""
    if isinstance(urls, str) or not urls:
        raise ValueError("urls: give a list of at least one base URL, e.g. ['http://127.0.0.1:8000']")
    for url in urls:
        if not isinstance(url, str) or not _URL.fullmatch(url):
            raise ValueError(f"url {url!r} is not of the form http(s)://host[:port]")
    for what, value in (("timeout", timeout), ("backoff", backoff), ("backoff_max", backoff_max)):
        if not value > 0:
            raise ValueError(f"{what} must be positive (got {value})")
    if backoff > backoff_max:
        raise ValueError(f"backoff ({backoff}) must not exceed backoff_max ({backoff_max})")
    if max_retries < 0:
        raise ValueError(f"max_retries must be at least 0 (got {max_retries})")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1 (got {max_concurrency})")
    if token_env is not None and not _TOKEN_ENV.fullmatch(token_env):
        raise ValueError(f"token_env {token_env!r} is not an environment variable name")

