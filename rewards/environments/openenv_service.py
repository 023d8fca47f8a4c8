"""OpenEnv's protocol on the environment service (docs/environments.md, "Serving to OpenEnv clients"), so OpenEnv's
own clients and `openenv validate --url` work against `relay env serve`.

Owns: `OpenEnvRoutes`: the WebSocket `/ws` (one environment session per connection; messages `reset`, `step`,
`state`, `close`, `mcp`), `GET /state`, `GET /schema`, `GET /metadata`, `POST /mcp` (JSON-RPC 2.0, `tools/list`), and
the stateless `POST /reset` / `POST /step` that service.py's routes hand over for bodies of OpenEnv's shape
(`is_openenv_reset`, `is_openenv_step`; how the two protocols share them: `OpenEnvRoutes`' docstring). Text actions
are `{"message": text}`, observations `{"text": ..., "info": {...}}` with `reward` and `done` beside them.
Does not own: sessions, deadlines and limits (sessions.py, whose `Sessions` runs every call here and in relay's
protocol), the health check and relay's own protocol (service.py), nor the clients (rewards/environments/remote.py,
openenv_client.py).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rewards.environments.interface import Environment, StepResult
from rewards.environments.sessions import ErrorReply, Session, Sessions, step_blocker
from rewards.http import authorized

log = logging.getLogger(__name__)

# OpenEnv's WebSocket error codes (openenv.core.env_server.types.WSErrorCode) and JSON-RPC 2.0's
INVALID_JSON, UNKNOWN_TYPE, VALIDATION_ERROR = "INVALID_JSON", "UNKNOWN_TYPE", "VALIDATION_ERROR"
EXECUTION_ERROR, CAPACITY_REACHED, SESSION_ERROR = "EXECUTION_ERROR", "CAPACITY_REACHED", "SESSION_ERROR"
RPC_PARSE_ERROR, RPC_INVALID_REQUEST, RPC_METHOD_NOT_FOUND, RPC_INTERNAL_ERROR = -32700, -32600, -32601, -32603
TOOLS_FAILED = "listing the environment's tools failed; see the service's log"


class TextAction(BaseModel):
    """An action: the model's text."""

    model_config = ConfigDict(extra="forbid")
    message: str = Field(description="The model's text of this turn")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Ignored by relay's environments")


class TextObservation(BaseModel):
    """An observation; on the wire `text` and `info` go under `observation`, `reward` and `done` beside it."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(description="Text appended to the episode after the action; may be empty")
    info: dict[str, Any] = Field(default_factory=dict, description="JSON-able extras, e.g. invalid_call")
    reward: float | None = Field(default=None, description="This turn's reward; null after a reset")
    done: bool = Field(default=False, description="The episode is over")


class EpisodeState(BaseModel):
    """The state of a session's episode."""

    episode_id: str | None = Field(default=None, description="The reset's episode_id, else one made up")
    step_count: int = Field(default=0, ge=0, description="Steps since the reset")


class ResetData(BaseModel):
    """A reset's data: `prompt` and `label` go to the environment's `reset(prompt, label)`."""

    model_config = ConfigDict(extra="ignore")  # as OpenEnv's server drops what the environment does not take
    prompt: str = ""
    label: Any = None
    seed: int | None = Field(default=None, ge=0, description="Accepted, unused: relay's environments take no seed")
    episode_id: str | None = Field(default=None, max_length=255)


class _StepBody(BaseModel):
    """A stateless `POST /step`: a fresh environment is reset with `prompt` and `label`, then steps."""

    model_config = ConfigDict(extra="ignore")
    action: dict[str, Any]
    prompt: str = ""
    label: Any = None


class _DataMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["reset", "step", "mcp"]
    data: dict[str, Any] = Field(default_factory=dict)


class _StepMessage(_DataMessage):
    data: dict[str, Any]


class _BareMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["state", "close"]


class _RpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    jsonrpc: Literal["2.0"]
    method: str
    params: dict[str, Any] = Field(default_factory=dict)
    id: str | int | None = None


def is_openenv_reset(body: bytes) -> bool:
    """Whether a `POST /reset` body is OpenEnv's (see the module's decisions)."""
    data = _json_object(body)
    if data is None:
        return not body.strip()
    return "seed" in data or "episode_id" in data or not ("prompt" in data or "label" in data)


def is_openenv_step(body: bytes) -> bool:
    """Whether a `POST /step` body is OpenEnv's: its `action` is an object."""
    data = _json_object(body)
    return data is not None and isinstance(data.get("action"), dict)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(body) if body.strip() else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _observation(text: str, info: dict[str, Any], reward: float | None, done: bool) -> dict[str, Any]:
    return {"observation": {"text": text, "info": info}, "reward": reward, "done": done}


def _error(message: str, code: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code, **extra}}


def _rpc_error(code: int, message: str, request_id: str | int | None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message, "data": None}}


class _Closed(Exception):
    """The WebSocket's session ended: send this error, then close."""

    def __init__(self, reply: dict[str, Any]):
        super().__init__(reply["data"]["message"])
        self.reply = reply


@dataclass(eq=False)
class _Connection:
    """One WebSocket: its session (a new one per reset after the first) and its episode's state."""

    session: Session
    episode_id: str | None = None
    step_count: int = 0


class OpenEnvRoutes:
    """OpenEnv's routes on a service whose sessions are `sessions` (sessions.py); `factory` makes its environments.

    Decisions:
    - Both protocols share `/reset` and `/step`, told apart by the body: relay's reset carries `prompt` or `label`
      and never OpenEnv's `seed` / `episode_id`; relay's step has a string `action`, OpenEnv's an object. Every other
      reset body (none, `{}`, `{"seed": 1}`, `{"prompt": ..., "episode_id": ...}`) is OpenEnv's; every other step
      body stays relay's. What relay's client sends is answered as before; only a reset body without `prompt` and
      `label` (a 422 before) changed owner.
    - One pool of sessions: a WebSocket holds one of the service's sessions (sessions.py) from its connection on, and
      each stateless reset or step one for the call, all within `max_sessions`. At capacity a WebSocket is accepted,
      answered `CAPACITY_REACHED` and closed, as OpenEnv's server does; a stateless call gets relay's 503. A reset on
      an open WebSocket starts a new episode on a new environment object (relay's environments are one per episode).
    - Calls keep relay's rules: `step_timeout` (past it: `EXECUTION_ERROR`), an environment that raises gives a
      generic message (the text goes to the log), an idle connection expires after `session_ttl` (`SESSION_ERROR`,
      closed).
    - The token guards every route here; a WebSocket without it is refused at the handshake (HTTP 403: uvicorn logs a
      spurious error for a 401 denial response). Before any of this, service.py's app refuses a handshake from a web
      page (a foreign `Origin`; browsers apply no CORS to WebSockets) and a stateless POST not declared JSON
      (rewards/http.py's `BrowserGuard`).
    - `/mcp` lists the tools of an environment with a `tools` mapping (relay's `ToolEnvironment`), none otherwise; it
      does not call them (`tools/call` is not served: tools run inside an episode's step).
    """

    def __init__(self, sessions: Sessions, factory: Callable[[], Environment], *, token: str | None,
                 max_body_bytes: int):
        self.sessions, self.factory = sessions, factory
        self.token, self.max_body_bytes = token, max_body_bytes
        self._tools: list[dict[str, Any]] | None = None
        self._tools_lock = asyncio.Lock()

    def add_routes(self, app: FastAPI, read: Callable[[Request], Any]) -> None:
        """Add `/ws`, `/state`, `/schema`, `/metadata`, `/mcp` to `app`; `read(request)` checks the token and the
        size of a request and returns its body (service.py's)."""
        name, description = _describe(self.factory)

        @app.get("/state", response_model=EpisodeState)
        async def state(request: Request):
            await read(request)
            return EpisodeState()  # each HTTP call has a fresh environment, as in OpenEnv's server

        @app.get("/schema")
        async def schema(request: Request):
            await read(request)
            return {"action": TextAction.model_json_schema(), "observation": TextObservation.model_json_schema(),
                    "state": EpisodeState.model_json_schema()}

        @app.get("/metadata")
        async def metadata(request: Request):
            await read(request)
            return {"name": name, "description": description}

        @app.post("/mcp")
        async def mcp(request: Request):
            body = await read(request)
            try:
                payload = json.loads(body)
            except ValueError:
                return _rpc_error(RPC_PARSE_ERROR, "Parse error", None)
            return await self.answer_rpc(payload)

        app.add_api_websocket_route("/ws", self.serve_websocket)

    # ------------------------------------------------------------ stateless HTTP

    async def reset(self, body: bytes) -> JSONResponse:
        """A stateless `POST /reset`: a fresh environment's initial observation."""
        data = ResetData.model_validate_json(body or b"{}")
        session = self.sessions.new()
        try:
            text = await self._call(session, session.episode.reset(data.prompt, data.label), "reset")
        finally:
            self.sessions.end(session, "stateless reset answered")
        return JSONResponse(_observation(text, {}, None, False))

    async def step(self, body: bytes) -> JSONResponse:
        """A stateless `POST /step`: a fresh environment reset with the body's `prompt` and `label`, then one step."""
        request = _StepBody.model_validate_json(body)
        action = TextAction.model_validate(request.action)
        session = self.sessions.new()
        try:
            result = await self._call(session, _reset_then_step(session, request, action.message), "step")
        finally:
            self.sessions.end(session, "stateless step answered")
        return JSONResponse(_observation(result.observation, result.info, result.reward, result.done))

    async def _call(self, session: Session, coro, what: str) -> Any:
        self.sessions.start(session, coro)
        return await self.sessions.reply(session, what)

    # ------------------------------------------------------------ WebSocket

    async def serve_websocket(self, websocket: WebSocket) -> None:
        """One OpenEnv session: refused without the token, answered `CAPACITY_REACHED` and closed at capacity."""
        if self.token is not None and not authorized(websocket, self.token):
            await websocket.close(code=1008)  # before accepting: the handshake's answer is HTTP 403
            return
        await websocket.accept()
        connection = None
        try:
            connection = _Connection(self._new_session())
            while (raw := await _receive(websocket)) is not None:
                reply = await self._answer(connection, raw)
                if reply is None:
                    break
                await websocket.send_text(json.dumps(reply))
        except WebSocketDisconnect:  # the client has gone
            pass
        except _Closed as closed:
            await _send_last(websocket, closed.reply)
        except Exception:  # a bug of this service: the client gets OpenEnv's last-resort error, the log the trace
            log.exception("openenv websocket: unexpected error")
            await _send_last(websocket, _error("internal error; see the service's log", SESSION_ERROR))
        finally:
            if connection is not None:
                self.sessions.end(connection.session, "websocket closed")
            await _close(websocket)

    def _new_session(self) -> Session:
        try:
            return self.sessions.new()
        except ErrorReply as reply:
            raise _Closed(_error(reply.detail, CAPACITY_REACHED, active_sessions=len(self.sessions.open),
                                 max_sessions=self.sessions.max_sessions)) from None

    async def _answer(self, connection: _Connection, raw: str) -> dict[str, Any] | None:
        """The reply to one message, or None for `close`."""
        if len(raw.encode()) > self.max_body_bytes:
            return _error(f"message exceeds max_body_bytes={self.max_body_bytes}; send a smaller one", VALIDATION_ERROR)
        try:
            message = json.loads(raw)
        except ValueError as error:
            return _error(f"Invalid JSON: {error}", INVALID_JSON)
        kind = message.get("type", "") if isinstance(message, dict) else ""
        if kind not in ("reset", "step", "state", "close", "mcp"):
            return _error(f"Unknown message type: {kind}", UNKNOWN_TYPE)
        if kind != "close" and self.sessions.open.get(connection.session.id) is not connection.session:
            raise _Closed(_error(f"the session expired after session_ttl={self.sessions.session_ttl:g}s idle; "
                                 "connect again", SESSION_ERROR))
        try:
            return await self._dispatch(connection, kind, message)
        except ValidationError as error:
            errors = error.errors(include_url=False, include_input=False, include_context=False)
            return _error("Invalid message", VALIDATION_ERROR, errors=json.loads(json.dumps(errors, default=str)))
        except ErrorReply as reply:
            return _error(reply.detail, EXECUTION_ERROR)

    async def _dispatch(self, connection: _Connection, kind: str, message: dict[str, Any]) -> dict[str, Any] | None:
        if kind == "reset":
            return await self._reset_episode(connection, ResetData.model_validate(
                _DataMessage.model_validate(message).data))
        if kind == "step":
            return await self._step_episode(connection, TextAction.model_validate(
                _StepMessage.model_validate(message).data))
        if kind == "mcp":
            return {"type": "mcp", "data": await self.answer_rpc(_DataMessage.model_validate(message).data)}
        _BareMessage.model_validate(message)
        if kind == "close":
            return None
        state = EpisodeState(episode_id=connection.episode_id, step_count=connection.step_count)
        return {"type": "state", "data": state.model_dump()}

    async def _reset_episode(self, connection: _Connection, data: ResetData) -> dict[str, Any]:
        if connection.session.task is not None:  # a new episode on a new environment object
            self.sessions.end(connection.session, "reset again")
            connection.session = self._new_session()
        connection.episode_id, connection.step_count = data.episode_id or uuid.uuid4().hex, 0
        session = connection.session
        text = await self._call(session, session.episode.reset(data.prompt, data.label), "reset")
        return {"type": "observation", "data": _observation(text, {}, None, False)}

    async def _step_episode(self, connection: _Connection, action: TextAction) -> dict[str, Any]:
        refusal = _cannot_step(connection.session)
        if refusal is not None:
            return _error(refusal, EXECUTION_ERROR)
        session = connection.session
        result = await self._call(session, session.episode.step(action.message), f"step {connection.step_count}")
        connection.step_count += 1
        return {"type": "observation", "data": _observation(result.observation, result.info, result.reward,
                                                            result.done)}

    # ------------------------------------------------------------ MCP

    async def answer_rpc(self, payload: Any) -> dict[str, Any]:
        """The JSON-RPC 2.0 reply to `payload`: `tools/list` is served, any other method is not found."""
        try:
            request = _RpcRequest.model_validate(payload)
        except ValidationError as error:
            problem = error.errors(include_url=False)[0]
            where = ".".join(str(part) for part in problem["loc"]) or "request"
            return _rpc_error(RPC_INVALID_REQUEST, f"Invalid request: {where}: {problem['msg']}", None)
        if request.method != "tools/list":
            return _rpc_error(RPC_METHOD_NOT_FOUND, f"Method not found: {request.method} (this service lists tools "
                              "with tools/list; they run inside an episode's step)", request.id)
        try:
            tools = await self._list_tools()
        except Exception:  # the environment's constructor or a tool's schema: may hold what a client should not see
            log.exception("mcp tools/list failed")
            return _rpc_error(RPC_INTERNAL_ERROR, TOOLS_FAILED, request.id)
        return {"jsonrpc": "2.0", "id": request.id, "result": {"tools": tools}}

    async def _list_tools(self) -> list[dict[str, Any]]:
        async with self._tools_lock:  # one environment object built, once
            if self._tools is None:
                self._tools = await asyncio.to_thread(_tools_of, self.factory)
        return self._tools


async def _reset_then_step(session: Session, request: _StepBody, action: str) -> StepResult:
    await session.episode.reset(request.prompt, request.label)
    return await session.episode.step(action)


def _cannot_step(session: Session) -> str | None:
    """Why the session cannot take a step now, or None."""
    if session.task is None:
        return "step before reset: send a reset first"
    return {"running": "the previous call is still running (past step_timeout): reset to start a new episode",
            "failed": "the episode failed (see the service's log): reset to start a new episode",
            "done": "the episode is done: reset to start a new episode"}.get(step_blocker(session))


async def _receive(websocket: WebSocket) -> str | None:
    """The next message's text, or None once the client has gone."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        return None
    text = message.get("text")
    return text if text is not None else (message.get("bytes") or b"").decode("utf-8", "replace")


async def _send_last(websocket: WebSocket, reply: dict[str, Any]) -> None:
    """Send the connection's last reply, unless the client has gone already."""
    try:
        await websocket.send_text(json.dumps(reply))
    except WebSocketDisconnect:
        pass


async def _close(websocket: WebSocket) -> None:
    try:
        await websocket.close()
    except (RuntimeError, WebSocketDisconnect):  # closed already, by the client or after an error
        pass


def _describe(factory: Callable[[], Environment]) -> tuple[str, str]:
    """The environment's name and description (its class's docstring's first paragraph) for `/metadata`."""
    cls = factory.func if isinstance(factory, partial) else factory
    if not inspect.isclass(cls):
        return getattr(cls, "__name__", "environment").strip("<>"), ""
    doc = inspect.getdoc(cls) or ""
    return cls.__name__, " ".join(doc.split("\n\n")[0].split())


def _tools_of(factory: Callable[[], Environment]) -> list[dict[str, Any]]:
    """MCP tool descriptions of an environment with a `tools` mapping (name -> function), else []."""
    from rewards.environments.tools import tool_schemas

    environment = factory()
    try:
        tools = getattr(environment, "tools", None)
        if not isinstance(tools, Mapping) or not tools:
            return []
        schemas = [schema["function"] for schema in tool_schemas(list(tools.values()))]
        return [{"name": name, "description": schema.get("description", ""),
                 "inputSchema": schema.get("parameters", {"type": "object"})}
                for name, schema in zip(tools, schemas)]
    finally:
        close = getattr(environment, "close", None)
        if callable(close):
            close()
