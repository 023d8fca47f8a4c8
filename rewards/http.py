"""The HTTP plumbing that the verifier and environment clients and services share, written once for all of them.

Owns, for the clients (rewards/remote.py, rewards/environments/remote.py, rewards/environments/openenv_client.py):
the retry loop (`retrying`, with full-jitter exponential backoff, and its faults `Retryable`, `Permanent`,
`RetriesFailed`), token scrubbing and the reading of a reply's status (`Redacting`), the wording of a transport error
(`describe_transport_error`), a client's private event loop (`EventLoopThread`), its bearer token (`bearer_token`:
refused where it would cross the network in clear text) and `is_finite_number`. For the services
(rewards/service.py, rewards/environments/service.py, openenv_service.py): the token from the environment
(`token_from_env`), the bearer-token check of a request and its 401 reply (`authorized`, `UNAUTHORIZED`,
`unauthorized`), FastAPI's own pages behind the token (`guard_docs`), and reading a body within its limit
(`read_body`).
Does not own: what any protocol sends or answers (the modules above), where a token may travel and loopback detection
(rewards/config.py: config validation needs them, and config modules import nothing of the project), nor serving an
app (rewards/service.py's `run_app`, `run_in_thread`).

Decisions:
- Nothing of a web framework is imported at the top: the clients import this module, and a rollout worker needs
  httpx, not FastAPI. `guard_docs` imports Starlette when a service calls it.
- A token is compared in constant time (`hmac.compare_digest`).
- `guard_docs` wraps the routes FastAPI adds itself rather than matching paths in a middleware: the guard goes with
  the route, whatever prefix (`root_path`) it is reached under.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import math
import os
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from rewards.config import clear_text_token_error

if TYPE_CHECKING:  # only named in annotations
    from fastapi import FastAPI
    from starlette.requests import HTTPConnection, Request

T = TypeVar("T")

UNAUTHORIZED = "missing or wrong bearer token (Authorization: Bearer <token>)"
"""The `detail` of a service's 401 reply."""


# ------------------------------------------------------------ clients


class Retryable(Exception):
    """A fault worth another attempt (refused, reset, timeout, 5xx, malformed reply)."""


class Permanent(Exception):
    """A fault not worth another attempt (4xx, or a 5xx whose body says `"retryable": false`)."""


class RetriesFailed(Exception):
    """`retrying` gave up; the message is the last attempt's reason (with how many retries ran)."""


async def retrying(attempt: Callable[[int], Awaitable[T]], *, max_retries: int, backoff: float, backoff_max: float,
                   timeout: float, on_retry: Callable[[str, float], None]) -> T:
    """`await attempt(k)` for k = 0, 1, ... until it returns: after a `Retryable`, a transport error or a timeout,
    again after a full-jitter exponential backoff (uniform in [0, min(backoff_max, backoff x 2^k)]), at most
    `max_retries` times; a `Permanent` ends it at once. `on_retry(reason, delay)` is told of each retry. Raises
    `RetriesFailed` with the last reason. The verifier and environment clients' one retry loop."""
    for k in range(max_retries + 1):
        try:
            return await attempt(k)
        except Permanent as err:
            raise RetriesFailed(str(err)) from None
        except Retryable as err:
            reason = str(err)
        except (httpx.RequestError, TimeoutError) as err:
            reason = describe_transport_error(err, timeout)
        if k == max_retries:
            break
        delay = random.uniform(0, min(backoff_max, backoff * 2**k))
        on_retry(reason, delay)
        await asyncio.sleep(delay)
    raise RetriesFailed(f"{max_retries} retries exhausted: {reason}" if max_retries else reason)


class Redacting:
    """A client's bearer token (`_secret`, None without one) kept out of every message it writes: text from or about
    the service is scrubbed whole before it is cut to length (cut first, a prefix of an echoed token would survive).
    Mixed into every client of this package."""

    _secret: str | None = None

    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def _excerpt(self, text: str, limit: int) -> str:
        """At most `limit` characters of `text` from the service, whitespace collapsed; scrubbed before the cut."""
        return " ".join(self._scrub(text).split())[:limit]

    def _snippet(self, response: httpx.Response) -> str:
        text = self._excerpt(response.text, 200)
        return f": {text}" if text else ""

    def _json_reply(self, response: httpx.Response, token_env: str | None) -> Any:
        """A 200 reply's JSON; else `Retryable` (5xx, another status, not JSON) or `Permanent` (4xx, with a hint on
        401/403; a 5xx whose body says `"retryable": false`), the service's text scrubbed and cut."""
        status = response.status_code
        if status >= 500:
            if _says_not_retryable(response):
                raise Permanent(f"HTTP {status}, not retried{self._snippet(response)}")
            raise Retryable(f"HTTP {status}{self._snippet(response)}")
        if status >= 400:
            hint = ""
            if status in (401, 403):
                hint = (f" (check the token in ${token_env})" if token_env
                        else " (the service wants a bearer token: set token_env)")
            raise Permanent(f"HTTP {status}, not retried{hint}{self._snippet(response)}")
        if status != 200:
            raise Retryable(f"unexpected HTTP {status}")
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise Retryable("malformed reply: not JSON") from None


def _says_not_retryable(response: httpx.Response) -> bool:
    """Whether a reply's JSON body says `"retryable": false`."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(body, dict) and body.get("retryable") is False


def describe_transport_error(err: Exception, timeout: float) -> str:
    """One line for a request that got no reply: a timeout, a refused or reset connection, or another transport
    error (httpx wraps the socket's error a few levels down)."""
    if isinstance(err, TimeoutError | httpx.TimeoutException):
        return f"no reply within timeout={timeout:g}s"
    cause = _os_error(err)
    if cause is not None and cause.errno == errno.ECONNREFUSED:
        return "connection refused"
    if cause is not None and cause.errno == errno.ECONNRESET:
        return "connection reset"
    what = "cannot connect" if isinstance(err, httpx.ConnectError) else "connection lost"
    detail = cause.strerror if cause is not None and cause.strerror else str(err) or type(err).__name__
    return f"{what}: {detail}"


def _os_error(err: BaseException) -> OSError | None:
    """The first OSError with an errno in the exception's chain of causes, if any."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        err = err.__cause__ or err.__context__
    return None


class EventLoopThread:
    """A client's private asyncio event loop, run in a daemon thread: its connections live there, so that one client
    serves synchronous callers (each request with a hard deadline, `asyncio.wait_for`) and sessions awaited from any
    event loop."""

    def __init__(self, name: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float) -> Any:
        """`coro`'s result, run on the loop, from a thread outside it; cancelled after `timeout` seconds
        (`TimeoutError`)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise

    async def call(self, coro) -> Any:
        """Await `coro`, run on the loop, from another event loop; cancelling the caller cancels it."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def stop(self, shutdown: Callable[[], Awaitable[None]]) -> None:
        """Cancel every task on the loop (their callers get `CancelledError`), await `shutdown()` there (close the
        connections), then stop the loop and its thread. Call once."""
        try:
            self.run(self._cancel_all(shutdown), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    @staticmethod
    async def _cancel_all(shutdown: Callable[[], Awaitable[None]]) -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await shutdown()


def bearer_token(token_env: str | None, urls: Sequence[str], allow_plain_http_token: bool) -> str | None:
    """The token a client sends to `urls`, from the environment variable `token_env` (None without one). A one-line
    `ValueError`, before the variable is read, if a URL would carry it in clear text (rewards/config.py's
    `clear_text_token_error`: the config refuses the same), or if the variable is unset or empty."""
    if (error := clear_text_token_error(urls, token_env, allow_plain_http_token)) is not None:
        raise ValueError(error)
    return token_from_env(token_env, "token_env")


def is_finite_number(value: Any) -> bool:
    """A JSON number that is finite: not a string, not `true`/`false`, not `null`, not NaN or infinity."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


# ------------------------------------------------------------ services and clients


def token_from_env(token_env: str | None, setting: str = "--token-env") -> str | None:
    """The bearer token held in the environment variable `token_env` (None without one); a one-line `ValueError`
    naming `setting` (what names the variable: a service's `--token-env`, a client's `token_env`) if it is unset or
    empty."""
    if not token_env:
        return None
    token = os.environ.get(token_env, "")
    if not token:
        raise ValueError(f"{setting}: environment variable {token_env} is unset or empty; export the service's bearer "
                         f"token in it, or remove {setting}")
    return token


# ------------------------------------------------------------ services


def authorized(connection: HTTPConnection, token: str) -> bool:
    """Whether a request (or WebSocket handshake) carries `Authorization: Bearer <token>`."""
    scheme, _, given = connection.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def unauthorized() -> Any:
    """A service's 401 reply to a request without its bearer token (a Starlette `JSONResponse`)."""
    from starlette.responses import JSONResponse

    return JSONResponse({"detail": UNAUTHORIZED}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None if it is larger than `limit` bytes (by Content-Length or as actually sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def guard_docs(app: FastAPI, token: str | None) -> None:
    """Put the pages FastAPI adds itself (the OpenAPI schema `/openapi.json`, Swagger UI `/docs`, ReDoc `/redoc`)
    behind `token` when there is one: they describe every route, which a caller without the token has no business
    reading. Without a token they stay open, as the service is (`openenv validate` reads `/openapi.json`)."""
    if token is None:
        return
    from starlette.routing import Route

    pages = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url} - {None}
    for route in app.routes:
        if isinstance(route, Route) and route.path in pages:
            route.app = _needs_token(route.app, token)


def _needs_token(page: Callable[..., Awaitable[None]], token: str) -> Callable[..., Awaitable[None]]:
    """The ASGI app `page`, answering 401 to a request without `token`."""
    from starlette.requests import Request

    async def guarded(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if authorized(Request(scope), token):
            await page(scope, receive, send)
        else:
            await unauthorized()(scope, receive, send)

    return guarded
