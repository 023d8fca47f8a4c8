"""The reference environment service (docs/environments.md, "The protocol": its sessions, idempotent steps, deadlines,
status codes and expiry): any in-process environment class over HTTP.

Owns: `create_app` (a FastAPI app speaking the remote environment protocol: `GET /health`, `POST /reset`,
`POST /step`, `POST /close`; optional bearer token; `/reset` and `/step` bodies of OpenEnv's shape handed to
OpenEnv's routes on the same app) and `app_from_spec` (the app for a `package.module:Class` spec, what `relay env
serve` runs). An environment that raises gives a generic 500 with `"retryable": false` (its text goes to the log).
Does not own: serving (rewards/service.py's `run_app` / `run_in_thread`), the token check, body reading and the
guard against web pages (rewards/http.py), the pool of sessions, their deadlines and expiry and the error reply
(rewards/environments/sessions.py), OpenEnv's protocol (rewards/environments/openenv_service.py), environments
(rewards/environments/interface.py), nor the client (rewards/environments/remote.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rewards.environments.interface import Environment, InProcessEnvironments
from rewards.environments.openenv_service import OpenEnvRoutes, is_openenv_reset, is_openenv_step
from rewards.environments.sessions import ErrorReply, Session, Sessions, step_blocker
from rewards.http import (
    UNAUTHORIZED,
    BrowserGuard,
    allowed_origins,
    authorized,
    guard_docs,
    read_body,
    token_from_env,
)


class ResetRequest(BaseModel):
    """Body of `POST /reset`."""

    model_config = ConfigDict(extra="ignore")
    prompt: str
    label: Any = None
    metadata: dict[str, Any] = {}


class ResetResponse(BaseModel):
    """Body of a 200 reply to `POST /reset`."""

    session_id: str
    observation: str


class StepRequest(BaseModel):
    """Body of `POST /step`."""

    model_config = ConfigDict(extra="ignore")
    session_id: str
    action: str
    turn: int = Field(ge=0)
    """0 for the first step after reset, then 1, 2, ...; the same turn again is a retry."""


class StepResponse(BaseModel):
    """Body of a 200 reply to `POST /step`."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = {}


class CloseRequest(BaseModel):
    """Body of `POST /close`."""

    model_config = ConfigDict(extra="ignore")
    session_id: str


def create_app(factory: Callable[[], Environment], *, token: str | None = None, max_sessions: int = 1024,
               session_ttl: float = 600.0, step_timeout: float = 30.0, workers: int = 8,
               max_body_bytes: int = 8 * 2**20, allow_origins: Sequence[str] = ()) -> FastAPI:
    """A FastAPI app serving the environments `factory` makes (one per session) with the remote environment protocol
    and OpenEnv's (rewards/environments/openenv_service.py).

    token: bearer token required by every endpoint but `/health`, FastAPI's `/openapi.json`, `/docs` and `/redoc`
    included (None: no authentication). max_sessions: sessions open at once (more: 503). session_ttl: seconds a
    session may stay idle before it expires. step_timeout: seconds a reply waits for its call (reset or step; longer:
    504). workers: threads running environment calls. max_body_bytes: largest request body (more: 413).
    allow_origins: web pages (`scheme://host[:port]`) allowed to call the service from a browser; every other
    `Origin` is refused, WebSockets included, as are POSTs not declared `application/json` and, on loopback, other
    hosts' names (rewards/http.py's `BrowserGuard`).

    Long because the app's route table reads in one place: the routes are closures over its state (the sessions,
    the token), each a few lines, written where FastAPI registers them."""
    if min(max_sessions, workers, max_body_bytes) < 1 or not (session_ttl > 0 and step_timeout > 0):
        raise ValueError("max_sessions, session_ttl, step_timeout, workers and max_body_bytes must be positive")
    origins = allowed_origins(allow_origins)
    environments = InProcessEnvironments(factory, max_concurrency=workers, timeout=None)  # deadlines: `reply`
    sessions = Sessions(environments, max_sessions, session_ttl, step_timeout)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        sweeper = asyncio.create_task(sessions.sweep())
        yield
        sweeper.cancel()
        await sessions.shutdown()
        environments.close()

    app = FastAPI(title="relay environment service", lifespan=lifespan, version="1.0.0",  # openenv-http/1.x
                  description="relay's remote environment protocol and OpenEnv's (docs/environments.md).")
    app.state.requires_token = token is not None  # read by run_app / run_in_thread to warn about open services
    app.state.serve_command = "relay env serve"
    app.state.sessions = sessions
    app.add_middleware(BrowserGuard, allowed=origins, serve_command="relay env serve")

    async def read(request: Request) -> bytes:
        if token is not None and not authorized(request, token):
            raise ErrorReply(401, UNAUTHORIZED)
        body = await read_body(request, max_body_bytes)
        if body is None:
            raise ErrorReply(413, f"request body exceeds max_body_bytes={max_body_bytes}")
        return body

    openenv = OpenEnvRoutes(sessions, factory, token=token, max_body_bytes=max_body_bytes)
    openenv.add_routes(app, read)

    app.add_exception_handler(ErrorReply, _error_reply)
    app.add_exception_handler(ValidationError, _invalid_body)

    @app.get("/health")
    async def health():
        if len(sessions.overdue) >= workers:
            return JSONResponse({"status": "unhealthy", "detail": f"{len(sessions.overdue)} calls are past "
                                 f"step_timeout={step_timeout:g}s and unfinished ({workers} workers)"}, status_code=503)
        return {"status": "healthy"}

    @app.post("/reset", response_model=ResetResponse, responses=_ERRORS)
    async def reset(request: Request):
        raw = await read(request)
        if is_openenv_reset(raw):
            return await openenv.reset(raw)
        body = ResetRequest.model_validate_json(raw)
        session = sessions.new()
        sessions.start(session, session.episode.reset(body.prompt, body.label))
        try:
            observation = await sessions.reply(session, "reset")
        except ErrorReply:
            sessions.end(session, "discarded: its reset failed")
            raise
        return ResetResponse(session_id=session.id, observation=observation)

    @app.post("/step", response_model=StepResponse, responses=_ERRORS)
    async def step(request: Request):
        raw = await read(request)
        if is_openenv_step(raw):
            return await openenv.step(raw)
        body = StepRequest.model_validate_json(raw)
        session = sessions.get(body.session_id)
        if body.turn == session.next_turn:
            _check_can_step(session, body.turn)
            sessions.start(session, session.episode.step(body.action))
            session.next_turn += 1
        elif body.turn != session.next_turn - 1 or session.next_turn == 0:
            raise ErrorReply(409, f"turn {body.turn} is out of order: the session's next turn is {session.next_turn}")
        result = await sessions.reply(session, f"step {body.turn}")
        return StepResponse(observation=result.observation, reward=result.reward, done=result.done, info=result.info)

    @app.post("/close", responses=_ERRORS)
    async def close(request: Request):
        body = CloseRequest.model_validate_json(await read(request))
        session = sessions.open.get(body.session_id)
        if session is not None:
            sessions.end(session, "closed")
        return {}

    guard_docs(app, token)
    return app


async def _error_reply(_: Request, reply: ErrorReply) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if reply.status == 401 else None
    body = {"detail": reply.detail} if reply.retryable else {"detail": reply.detail, "retryable": False}
    return JSONResponse(body, status_code=reply.status, headers=headers)


async def _invalid_body(_: Request, err: ValidationError) -> JSONResponse:
    detail = err.errors(include_url=False, include_input=False, include_context=False)
    return JSONResponse({"detail": jsonable_encoder(detail)}, status_code=422)


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "missing or wrong bearer token"},
    404: {"description": "unknown session: closed, expired or never created"},
    409: {"description": "turn out of order, the previous turn still running or failed, or the episode is done"},
    413: {"description": "body larger than max_body_bytes"},
    422: {"description": "body is not a valid request"},
    500: {"description": "the environment raised or returned an invalid result (details in the service's log)"},
    503: {"description": "max_sessions sessions are open"},
    504: {"description": "the call ran past step_timeout; the same request again waits for it"},
}


def _check_can_step(session: Session, turn: int) -> None:
    """Raise 409 unless the session can take a new turn: its last call finished, succeeded, and was not done."""
    previous = "the reset" if turn == 0 else f"turn {turn - 1}"
    blocker = step_blocker(session)
    if blocker == "running":
        raise ErrorReply(409, f"{previous} is still running: send it again for its reply, then turn {turn}")
    if blocker == "failed":
        raise ErrorReply(409, f"{previous} failed: the session takes no further turn; close it")
    if blocker == "done":
        raise ErrorReply(409, f"the episode is done ({previous} answered done=true); close the session")


def app_from_spec(spec: str, *, params: Mapping[str, Any] | None = None, token_env: str | None = None,
                  **options: Any) -> FastAPI:
    """`create_app` for the environment class `spec` (`package.module:Class`) with `params` bound as constructor
    keyword arguments. The token, if any, is read from the environment variable `token_env`. Raises ValueError (one
    line) for a bad spec or params, an unset token variable or a bad option."""
    from rewards.environments.interface import load_environment

    factory = load_environment(spec, params)
    return create_app(factory, token=token_from_env(token_env), **options)
