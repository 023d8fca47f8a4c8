"""The client of OpenEnv servers (docs/environments.md, "Training against an OpenEnv server"): `env.protocol: openenv`.

Owns: `OpenEnvEnvironments`, episode sessions on servers built with openenv-core's `create_app`: one WebSocket
session (`/ws`) per episode, new sessions round-robin over the URLs, at most `max_concurrency` sessions open at
once, a deadline per call, text mapped to and from OpenEnv's dicts (`action_field`, `observation_field`), metrics;
what is retried and how a connection closes: its docstring.
Does not own: the retry loop, token scrubbing, transport-error wording, the private event loop, reading the token and
refusing to send it in clear text (rewards/http.py, shared with every client), argument checks, `LoopClient`,
`LoopSession` and `RemoteEnvironmentError` (rewards/environments/remote.py, shared with relay's own protocol's
client), the failure policy (actors/episodes.py, cluster/run/scoring.py), nor serving OpenEnv.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from rewards.environments.interface import CallStats, EpisodeSession, StepResult
from rewards.environments.remote import LoopClient, LoopSession, RemoteEnvironmentError, check_arguments
from rewards.http import (
    EventLoopThread,
    Permanent,
    Redacting,
    RetriesFailed,
    Retryable,
    bearer_token,
    describe_transport_error,
    is_finite_number,
    retrying,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 * 2**20  # a reply larger than this closes the connection (as relay's service's body limit)


class OpenEnvEnvironments(LoopClient, Redacting):
    """Episode sessions on OpenEnv servers; the arguments mirror `RemoteEnvironments`, plus the field mapping.

    Usage: `with OpenEnvEnvironments(["http://10.0.0.5:8000"]) as environments:`, then in a coroutine
    `session = environments.open(); await session.reset(prompt, label); await session.step(action); await
    session.close()`. urls: the servers' base URLs (`http(s)://host:port`; the WebSocket is `ws(s)://host:port/ws`).
    action_field: the action's field for the model's text. observation_field: the observation's text field.
    timeout: deadline of opening a session (with its reset), of a step, of a close (seconds). max_retries, backoff,
    backoff_max: retries of opening a session. max_concurrency: sessions open at once (a session holds its slot from
    its `reset` until its `close`: close every session). token_env: environment variable holding the bearer token,
    sent on the WebSocket handshake. allow_plain_http_token: send it over plain ws (an `http://` URL) to a host that
    is not loopback anyway (else refused).

    Decisions:
    - OpenEnv's HTTP `/reset` and `/step` keep no state (each makes a fresh environment). Its sessions live on `/ws`,
      one environment per connection, made when the connection opens and closed when it closes. So a session here is
      one connection: opened by `reset`, closed by `close`; `reset` sends the episode's `prompt` and `label` as reset
      data, which OpenEnv passes to an environment whose `reset` takes them as keyword arguments.
    - Only opening a session (connect + reset) is retried: after a refused or reset connection, a timeout, a 5xx
      handshake or a connection closed without a reply, on the next URL. A failed attempt's connection is closed,
      which ends its environment on the server, so a retried reset leaves nothing behind. A step is sent once:
      OpenEnv steps carry no turn index, so a step whose reply was lost or late may have been applied, and the
      episode fails instead.
    - An error reply (`{"type": "error"}`: the environment raised, the action failed validation), a malformed reply
      and a 4xx handshake fail the call at once: the same request would get them again. `CAPACITY_REACHED` is
      retried like a refused connection (backoff, next URL): the server frees an environment whenever a session
      ends. Every failure raises `RemoteEnvironmentError` (one line, token scrubbed) and is counted.
    - `max_concurrency` bounds sessions, not requests: a slot is taken before connecting and held until `close`,
      because an OpenEnv server holds an environment per open connection (`max_concurrent_envs`) and refuses the
      next one.
    - A connection is closed politely: a `close` message, then the server closes it (OpenEnv's server logs an error
      when the client closes first, and closes the environment before the connection). That holds for one whose
      reply is late too: OpenEnv's server runs the late call to its end and frees the environment only then, so the
      session's slot stays taken until the server has closed the connection (`timeout` seconds at most, then it is
      dropped), and the slot's next session, at `max_concurrency` x workers = `max_concurrent_envs`, finds room
      instead of `CAPACITY_REACHED`. A reset past its deadline waits the same way before its retry. Only a cancelled
      call drops its connection at once.
    - Connections live on the private loop of `EventLoopThread`, as `RemoteEnvironments`' requests do: sessions can
      be awaited from any event loop, and keepalive pings are answered while the worker's loop steps the engine.
    - A null reward (OpenEnv's default) counts as 0, `true`/`false` as 1/0; an `info` object in the observation is
      passed on (anything else under that name is ignored).
    """

    def __init__(self, urls: Sequence[str], *, action_field: str = "message", observation_field: str = "text",
                 timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.25, backoff_max: float = 8.0,
                 max_concurrency: int = 32, token_env: str | None = None, verify_tls: bool = True,
                 allow_plain_http_token: bool = False, name: str = "environment"):
        check_arguments(urls, timeout, max_retries, backoff, backoff_max, max_concurrency, token_env)
        for what, value in (("action_field", action_field), ("observation_field", observation_field)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{what} must be a non-empty field name (got {value!r})")
        self.name, self.timeout, self.max_retries = name, timeout, max_retries
        self.backoff, self.backoff_max, self.max_concurrency = backoff, backoff_max, max_concurrency
        self.action_field, self.observation_field, self.token_env = action_field, observation_field, token_env
        self._urls = [_ws_url(url) for url in urls]
        self._secret: str | None = bearer_token(token_env, urls, allow_plain_http_token)
        self._headers = {"Authorization": f"Bearer {self._secret}"} if self._secret else {}
        self._ssl = None if verify_tls else _unverified_tls()
        self._stats = CallStats()
        self._next_url = 0  # round-robin position of the next new session; used on the private loop only
        self._open: set[ClientConnection] = set()  # on the private loop only
        self._lingering: set[asyncio.Task] = set()  # hang-ups of late connections (`_linger`); on the private loop
        self._slots = asyncio.Semaphore(max_concurrency)  # bound to the private loop, its only user
        self._closed = False
        self._loop = EventLoopThread(f"relay-openenv-{name}")

    def __repr__(self) -> str:
        return (f"OpenEnvEnvironments(name={self.name!r}, urls={self._urls!r}, "
                f"token={'<from $' + self.token_env + '>' if self.token_env else None})")

    def _new_session(self) -> EpisodeSession:
        return _OpenEnvSession(self)

    def close(self) -> None:
        """Cancel calls in flight (their callers get `CancelledError`), drop the open connections (the servers close
        their environments) and stop the private event loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop(self._drop_all)

    async def _drop_all(self) -> None:
        for ws in list(self._open):
            self._drop(ws)

    def _drop(self, ws: ClientConnection) -> None:
        """Abandon a connection at once (no closing handshake, which could wait): the server sees it gone and closes
        its environment once no call of it runs. For connections whose polite hang-up failed, and on `close`."""
        self._open.discard(ws)
        ws.transport.abort()

    async def _hang_up(self, ws: ClientConnection, polite: bool) -> None:
        """Close a connection: `polite`ly (a close message, then the closing handshake, within the deadline) if it
        works; dropped if not, or if that fails or is cancelled."""
        try:
            if polite:
                await asyncio.wait_for(self._goodbye(ws), timeout=self.timeout)
        except (OSError, TimeoutError):
            pass  # dropped below, as a connection that did not work
        finally:
            if ws in self._open:
                self._drop(ws)

    def _failed(self, url: str, what: str, reason: str) -> RemoteEnvironmentError:
        self._stats.add(failures=1)
        message = self._scrub(f"environment '{self.name}' at {url}: {what} failed: {reason}")
        log.warning("%s", message)
        return RemoteEnvironmentError(message, url=url, call=what)

    async def _start(self, session: _OpenEnvSession, data: dict[str, Any]) -> StepResult:
        """Take a session slot (held until `_finish`), connect to the next URL in turn and reset there (retries: the
        URLs after it); sets the session's connection and URL."""
        self._stats.add(calls=1)
        await self._slots.acquire()
        session.holds_slot = True
        urls = self._rotation()
        url = urls[0]

        async def attempt(k: int) -> StepResult:
            nonlocal url
            url = urls[k % len(urls)]
            opened: list[ClientConnection] = []
            started = time.perf_counter()
            try:
                result = await asyncio.wait_for(self._connect_and_reset(url, data, opened), timeout=self.timeout)
            except BaseException as err:  # a failed attempt leaves no session: its environment freed before a retry
                if opened:
                    await self._hang_up(opened[0], polite=not isinstance(err, asyncio.CancelledError))
                raise
            self._stats.latency(time.perf_counter() - started)
            session.ws, session.url = opened[0], url
            return result

        def retried(reason: str, delay: float) -> None:
            self._stats.add(retries=1)
            log.debug("environment '%s' at %s: reset: %s; retry in %.2fs", self.name, url, self._scrub(reason), delay)

        try:
            return await retrying(attempt, max_retries=self.max_retries, backoff=self.backoff,
                                  backoff_max=self.backoff_max, timeout=self.timeout, on_retry=retried)
        except RetriesFailed as err:
            raise self._failed(url, "reset", str(err)) from None

    async def _connect_and_reset(self, url: str, data: dict[str, Any], opened: list[ClientConnection]) -> StepResult:
        """One attempt: a new connection (a new environment on the server), put in `opened`, and its reset."""
        ws = await self._connect(url)
        opened.append(ws)
        try:
            reply = await self._exchange(ws, {"type": "reset", "data": data})
        except ConnectionClosed:
            raise Retryable("the server closed the connection without a reply") from None
        return self._read(reply)

    async def _connect(self, url: str) -> ClientConnection:
        """An open WebSocket to `url`; `Retryable` for faults a later attempt may not meet, `Permanent` else."""
        options: dict[str, Any] = {"ssl": self._ssl} if self._ssl is not None and url.startswith("wss:") else {}
        try:
            ws = await connect(url, additional_headers=self._headers, open_timeout=None, max_size=MAX_MESSAGE_BYTES,
                               close_timeout=self.timeout, **options)
        except InvalidStatus as err:
            raise self._refused(err.response.status_code, url) from None
        except InvalidHandshake as err:
            raise Retryable(self._excerpt(f"WebSocket handshake failed: {err}", 200)) from None
        except OSError as err:  # refused, reset, unreachable (TimeoutError is the deadline's: `retrying` words it)
            if isinstance(err, TimeoutError):
                raise
            reason = describe_transport_error(err, self.timeout)
            raise Retryable(reason.replace("connection lost:", "cannot connect:")) from None
        self._open.add(ws)
        return ws

    def _refused(self, status: int, url: str) -> Exception:
        """The fault of a handshake answered with HTTP `status` instead of the WebSocket."""
        if status >= 500:
            return Retryable(f"HTTP {status} on the WebSocket handshake")
        hint = ""
        if status in (401, 403):  # Starlette refuses a WebSocket to a path it has no route for with 403 too
            hint = (f" (check the token in ${self.token_env}, and that the server is OpenEnv's)" if self.token_env
                    else " (the server wants a bearer token: set env.token_env; or it is not an OpenEnv server)")
        elif status == 404:
            hint = f" (no OpenEnv WebSocket at {url}: is it an OpenEnv server?)"
        return Permanent(f"HTTP {status} on the WebSocket handshake, not retried{hint}")

    async def _step(self, session: _OpenEnvSession, what: str, action: str) -> StepResult:
        """Send one step and read its reply, once; any failure fails the episode (a connection without its reply is
        dropped)."""
        self._stats.add(calls=1)
        started = time.perf_counter()
        try:
            reply = await asyncio.wait_for(self._exchange(session.ws, {"type": "step", "data": {
                self.action_field: action}}), timeout=self.timeout)
            result = self._read(reply)
        except (Retryable, Permanent) as err:  # a reply: the connection works, and `close` ends it politely
            raise self._failed(session.url, what, str(err)) from None
        except TimeoutError:
            reason = f"no reply within timeout={self.timeout:g}s; not retried (the step may have been applied)"
        except ConnectionClosed:
            reason = "the connection was lost; not retried (the step may have been applied)"
        except OSError as err:
            reason = f"{describe_transport_error(err, self.timeout)}; not retried (the step may have been applied)"
        else:
            self._stats.latency(time.perf_counter() - started)
            return result
        self._linger(session)
        raise self._failed(session.url, what, reason)

    def _linger(self, session: _OpenEnvSession) -> None:
        """Hang up a session whose reply is late or lost, in the background: its slot is released once the server
        has closed the connection (after freeing the environment the late call holds) or `timeout` has passed."""
        ws, session.ws = session.ws, None
        holds_slot, session.holds_slot = session.holds_slot, False

        async def hang_up() -> None:
            try:
                await self._hang_up(ws, polite=True)
            finally:
                if holds_slot:
                    self._slots.release()

        task = asyncio.create_task(hang_up())
        self._lingering.add(task)  # a reference, so the task is not collected before it ends
        task.add_done_callback(self._lingering.discard)

    async def _finish(self, session: _OpenEnvSession) -> None:
        """End the session: tell the server and close the connection within the deadline (else drop it); free the
        slot. Never raises `RemoteEnvironmentError`: a failed close is logged and counted."""
        ws, session.ws = session.ws, None
        try:
            if ws is not None and ws in self._open:
                self._stats.add(calls=1)
                try:
                    await asyncio.wait_for(self._goodbye(ws), timeout=self.timeout)
                except (OSError, TimeoutError) as err:
                    self._failed(session.url, "close", describe_transport_error(err, self.timeout))  # log, count
                finally:
                    if ws in self._open:
                        self._drop(ws)
        finally:
            if session.holds_slot:
                session.holds_slot = False
                self._slots.release()

    async def _goodbye(self, ws: ClientConnection) -> None:
        """Ask the server to end the session, and wait for it to close the connection (OpenEnv's server closes it
        after closing the environment, and logs an error if the client has closed it first)."""
        try:
            await ws.send(json.dumps({"type": "close"}))
        except ConnectionClosed:  # the server closed it first: its environment is gone all the same
            pass
        await ws.wait_closed()
        self._open.discard(ws)

    @staticmethod
    async def _exchange(ws: ClientConnection, message: dict[str, Any]) -> Any:
        """Send `message`, return the reply's JSON (`Permanent` if it is not JSON)."""
        try:
            await ws.send(json.dumps(message))
        except ConnectionClosed:  # a reply the server sent before closing (capacity reached) is still read below
            pass
        raw = await ws.recv()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise Permanent("malformed reply: not JSON") from None

    def _read(self, reply: Any) -> StepResult:
        """An observation reply as a `StepResult`; `Permanent` for an error reply or a malformed one."""
        kind, data = (reply.get("type"), reply.get("data")) if isinstance(reply, dict) else (None, None)
        if kind == "error":
            data = data if isinstance(data, dict) else {}
            raise (Retryable if data.get("code") == "CAPACITY_REACHED" else Permanent)(self._error(data))
        if kind != "observation" or not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
            raise Permanent(f'malformed reply: expected {{"type": "observation", "data": {{"observation": {{...}}, '
                            f'...}}}}, got {self._quote(reply)}')
        observation, reward, done = data["observation"], data.get("reward"), data.get("done")
        text = observation.get(self.observation_field)
        if not isinstance(text, str):
            fields = ", ".join(sorted(map(str, observation))) or "none"
            raise Permanent(f"malformed reply: the observation has no text field {self.observation_field!r} (its "
                            f"fields: {self._excerpt(fields, 100)}); set env.observation_field")
        if reward is None or isinstance(reward, bool):
            reward = float(bool(reward))
        elif not is_finite_number(reward):
            raise Permanent(f"malformed reply: reward {self._quote(reward)} is not a finite number or null")
        if not isinstance(done, bool):
            raise Permanent(f"malformed reply: done {self._quote(done)} is not true or false")
        info = observation.get("info")
        return StepResult(text, float(reward), done, info if isinstance(info, dict) else {})

    def _error(self, data: dict[str, Any]) -> str:
        """One line for an error reply: its code and message, and what to do about the usual ones."""
        code, message = str(data.get("code", "unknown")), str(data.get("message", ""))
        if code == "VALIDATION_ERROR" and isinstance(data.get("errors"), list):
            problems = [f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in data["errors"]
                        if isinstance(e, dict)]
            message = f"{message}: {'; '.join(problems)}"
        hint = {"CAPACITY_REACHED": " (the server's max_concurrent_envs is reached: keep env.max_concurrency times "
                                    "the rollout workers within it, or raise it)",
                "VALIDATION_ERROR": f" (an action is {{{self.action_field!r}: text}}: check env.action_field)",
                "EXECUTION_ERROR": " (the environment raised)"}.get(code, "")
        return f"the server answered error {code}: {self._excerpt(message, 200)}{hint}"

    def _quote(self, value: Any) -> str:
        return self._excerpt(json.dumps(value), 80)


class _OpenEnvSession(LoopSession):
    """One episode on an OpenEnv server: a WebSocket opened by `reset`, whose steps and close then use it."""

    def __init__(self, owner: OpenEnvEnvironments):
        super().__init__(owner)
        self.ws: ClientConnection | None = None  # set and cleared on the owner's loop
        self.url = ""
        self.holds_slot = False

    async def _send_reset(self, prompt: str, label: Any) -> str:
        return (await self._owner._start(self, {"prompt": prompt, "label": label})).observation

    async def _send_step(self, what: str, action: str) -> StepResult:
        return await self._owner._step(self, what, action)

    async def _end(self) -> None:
        await self._owner._on_loop(self._owner._finish(self))


def _ws_url(url: str) -> str:
    """`http(s)://host:port` -> `ws(s)://host:port/ws`, OpenEnv's session endpoint."""
    url = url.rstrip("/")
    return ("wss://" + url[len("https://"):] if url.startswith("https://") else "ws://" + url[len("http://"):]) + "/ws"


def _unverified_tls() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
