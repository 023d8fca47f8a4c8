"""The HTTP plumbing that the verifier and environment clients and services share, written once for all of them.

Owns, for the clients: the retry loop (`retrying`: full-jitter exponential backoff; `Retryable`, `Permanent`,
`RetriesFailed`), token scrubbing and a reply's status (`Redacting`), a transport error's wording
(`describe_transport_error`), a client's private event loop (`EventLoopThread`), its bearer token (`bearer_token`:
refused where it would cross the network in clear text) and `is_finite_number`. For the services: the token from the
environment (`token_from_env`), a request's token check in constant time and its 401 (`authorized`, `UNAUTHORIZED`,
`unauthorized`), FastAPI's own pages behind the token (`guard_docs`), a body read within its limit (`read_body`), and
what keeps web pages in a browser out of every service (`BrowserGuard`, `allowed_origins`). No web framework is
imported at the top: a rollout worker's clients need httpx, not FastAPI.
Does not own: what any protocol sends or answers, where a token may travel and loopback detection
(rewards/config.py), nor serving an app (rewards/service.py's `run_app`, `run_in_thread`).
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
from urllib.parse import urlsplit

import httpx

from rewards.config import clear_text_token_error, is_loopback

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
    """Whether a request (or WebSocket handshake) carries `Authorization: Bearer <token>` (compared in constant
    time)."""
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


def allowed_origins(origins: Sequence[str], setting: str = "--allow-origin") -> frozenset[str]:
    """`origins` as `BrowserGuard` compares them (lower case, no trailing slash); a one-line `ValueError` naming
    `setting` for one that is not `scheme://host[:port]` (http or https, no path)."""
    out = set()
    for origin in origins:
        parts = urlsplit(origin.strip().rstrip("/").lower())
        try:
            parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
        except ValueError:
            parts = parts._replace(netloc="")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment:
            raise ValueError(f"{setting} {origin!r} is not an origin: give scheme://host[:port], e.g. "
                             "https://dashboard.example:8443")
        out.add(f"{parts.scheme}://{parts.netloc}")
    return frozenset(out)


class BrowserGuard:
    """ASGI middleware every service puts in front of its routes, so a web page in a browser on this machine cannot
    use a service it can reach (docs/operations.md, "Security"). In order:

    - a request or WebSocket handshake reached on a loopback address whose `Host` names another host is refused
      (403): a page whose DNS name was rebound to 127.0.0.1 sends its own name there;
    - one with an `Origin` (browsers send it on every WebSocket handshake and cross-origin request; relay's, OpenEnv's
      and OpenRLHF's clients never do) is refused (403) unless the origin is allowed (`allowed`, from
      `allowed_origins`) or is the service's own on loopback (its `/docs` page);
    - a POST, PUT or PATCH whose body is not declared `application/json` gets 415: a page may send `text/plain`
      anywhere without asking (no CORS preflight), and the body would otherwise be read as JSON all the same.

    A refused handshake is closed before it is accepted (HTTP 403). Plain ASGI: nothing of a web framework imported.

    A middleware, not a check in each route: every route of every service (relay's protocols, OpenEnv's WebSocket,
    OpenRLHF's `/get_reward`, FastAPI's pages) is behind it, routes added later included. Whether a request came on
    loopback is read from the connection's own address (ASGI `server`), not from the address the service was asked
    to bind, so an app served any way gets it.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], allowed: frozenset[str] = frozenset(),
                 serve_command: str = "relay verifier serve"):
        self.app, self.allowed, self.serve_command = app, allowed, serve_command

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = self.refusal(scope)
            if refusal is not None:
                await _refuse(scope, receive, send, *refusal)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: dict[str, Any]) -> tuple[int, str] | None:
        """(status, one line) refusing the request, or None to let it through."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = headers.get("host", "")
        server = scope.get("server") or ("", None)
        on_loopback = is_loopback(server[0])
        if on_loopback and host and not is_loopback(_hostname(host)):
            return 403, (f"Host {host} is not this machine: a service reached on loopback answers requests to "
                         "localhost, 127.0.0.1 or [::1] only (DNS rebinding)")
        origin = headers.get("origin")
        if origin is not None and not self._admits(origin, host, on_loopback):
            return 403, (f"Origin {origin} may not use this service: web pages are refused unless allowed "
                         f"({self.serve_command} --allow-origin ORIGIN)")
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT", "PATCH"):
            declared = headers.get("content-type", "")
            if declared.split(";")[0].strip().lower() != "application/json":
                got = repr(declared) if declared else "none"
                return 415, (f"Content-Type must be application/json (got {got}); send the body as JSON with that "
                             "header")
        return None

    def _admits(self, origin: str, host: str, on_loopback: bool) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if origin in self.allowed:
            return True
        scheme, _, netloc = origin.partition("://")  # the service's own pages: same origin, on loopback
        return on_loopback and scheme in ("http", "https") and netloc == host.lower() and is_loopback(_hostname(host))


def _hostname(host: str) -> str:
    """The name in a `Host` header: without its port, an IPv6 address without its brackets."""
    return urlsplit(f"//{host}").hostname or ""


async def _refuse(scope: dict[str, Any], receive: Callable, send: Callable, status: int, detail: str) -> None:
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008})  # before accepting: the handshake's answer is HTTP 403
        return
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def guard_docs(app: FastAPI, token: str | None) -> None:
    """Put the pages FastAPI adds itself (the OpenAPI schema `/openapi.json`, Swagger UI `/docs`, ReDoc `/redoc`)
    behind `token` when there is one: they describe every route, which a caller without the token has no business
    reading. Without a token they stay open, as the service is (`openenv validate` reads `/openapi.json`). The routes
    FastAPI added are wrapped, rather than their paths matched in a middleware: the guard goes with the route,
    whatever prefix (`root_path`) it is reached under; Starlette is imported only here."""
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
