"""The environment service's sessions, which relay's protocol (rewards/environments/service.py) and OpenEnv's
(rewards/environments/openenv_service.py) share on one app: a pool of them within `max_sessions`, each one
`InProcessEnvironments` session with its last call; deadlines on replies, expiry when idle, closes in the
background, and the error reply (`ErrorReply`) both protocols word their way.

Here, below both protocol modules, so that neither imports the other for them. Records go to the service's log
(`rewards.environments.service`), as they did when this code was part of it.
Does not own: the routes, request bodies or how a protocol words an error (service.py, openenv_service.py), nor
running environments (rewards/environments/interface.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rewards.environments.interface import EpisodeError, EpisodeSession, InProcessEnvironments, StepResult

log = logging.getLogger("rewards.environments.service")  # the service's log, whose records these are

ENVIRONMENT_FAILED = "the environment raised an exception or returned an invalid result; see the service's log"
"""The `detail` of a 500 reply: the environment failed."""


class ErrorReply(Exception):
    """An error reply: status and detail."""

    def __init__(self, status: int, detail: str, retryable: bool = True):
        super().__init__(detail)
        self.status, self.detail, self.retryable = status, detail, retryable


@dataclass(eq=False)
class Session:
    """One session: its episode on its own environment object, and its last call."""

    id: str
    episode: EpisodeSession
    last_used: float  # monotonic time of the last request's arrival or reply
    next_turn: int = 0
    task: asyncio.Task | None = None  # the last call: the reset, then the step of turn next_turn - 1

    def idle_since(self) -> float | None:
        """When the session went idle, or None while its last call runs."""
        return self.last_used if self.task is None or self.task.done() else None


class Sessions:
    """The service's sessions, its calls past their deadline and its background closes; used on the event loop."""

    def __init__(self, environments: InProcessEnvironments, max_sessions: int, session_ttl: float,
                 step_timeout: float):
        self.environments, self.max_sessions = environments, max_sessions
        self.session_ttl, self.step_timeout = session_ttl, step_timeout
        self.open: dict[str, Session] = {}
        self.overdue: set[asyncio.Task] = set()  # calls whose reply gave up on them, until they finish
        self._closing: set[asyncio.Task] = set()

    def new(self) -> Session:
        if len(self.open) >= self.max_sessions:
            self.expire_idle()
        if len(self.open) >= self.max_sessions:
            raise ErrorReply(503, f"max_sessions={self.max_sessions} sessions are open; retry later")
        session = Session(uuid.uuid4().hex, self.environments.open(), time.monotonic())
        self.open[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.open.get(session_id)
        if session is not None and self._expired(session, time.monotonic()):
            self.end(session, "expired")
            session = None
        if session is None:
            raise ErrorReply(404, f"unknown session {session_id[:64]!r}: closed, expired after session_ttl="
                              f"{self.session_ttl:g}s idle, or never created; reset a new one")
        return session

    def _expired(self, session: Session, now: float) -> bool:
        since = session.idle_since()
        return since is not None and now - since > self.session_ttl

    def expire_idle(self) -> None:
        now = time.monotonic()
        for session in [s for s in self.open.values() if self._expired(s, now)]:
            self.end(session, "expired")

    def end(self, session: Session, why: str, cancel: bool = False) -> None:
        """Forget the session and close its environment in the background, once its last call has finished (or, with
        `cancel`, at once: a call in a thread still runs on, and the environment is closed after it)."""
        if self.open.pop(session.id, None) is None:
            return
        log.debug("session %s %s", session.id, why)
        if cancel and session.task is not None:
            session.task.cancel()
        closing = asyncio.create_task(self._close(session))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close(session: Session) -> None:
        if session.task is not None:  # its outcome went to a reply or the log; waiting keeps `overdue` true
            await asyncio.wait([session.task])
        await session.episode.close()

    def start(self, session: Session, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda done: _log_failure(session.id, done))
        session.task = task
        return task

    async def reply(self, session: Session, what: str) -> Any:
        """The result of the session's last call, waiting at most `step_timeout`; else raise `ErrorReply`."""
        task = session.task
        session.last_used = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.step_timeout)
        except TimeoutError:
            if task not in self.overdue:
                self.overdue.add(task)
                task.add_done_callback(self.overdue.discard)
            raise ErrorReply(504, f"{what} took longer than step_timeout={self.step_timeout:g}s") from None
        except EpisodeError:
            raise ErrorReply(500, ENVIRONMENT_FAILED, retryable=False) from None
        except asyncio.CancelledError:
            if task.cancelled():  # the service is shutting down
                raise ErrorReply(503, f"the service shut down during {what}") from None
            raise
        finally:
            session.last_used = time.monotonic()

    async def sweep(self) -> None:
        """Expire idle sessions every so often, for ever (cancelled at shutdown)."""
        while True:
            await asyncio.sleep(max(0.05, min(self.session_ttl / 2, 30.0)))
            self.expire_idle()

    async def shutdown(self) -> None:
        for session in list(self.open.values()):
            self.end(session, "closed at shutdown", cancel=True)
        if self._closing:
            await asyncio.wait(self._closing, timeout=5)


def _log_failure(session_id: str, task: asyncio.Task) -> None:
    if task.cancelled() or task.exception() is None:
        return
    error = task.exception()
    if isinstance(error, EpisodeError):
        log.error("session %s: %s", session_id, error, exc_info=error)
    else:  # a bug of this service, not of the environment
        log.error("session %s: unexpected error", session_id, exc_info=error)


def step_blocker(session: Session) -> str | None:
    """What in the session's last call keeps it from a new turn: `running` (not finished), `failed`, or `done` (it
    answered done=true, whether or not a reply carried it); None when it may step or has had no call. Both protocols'
    step checks (service.py's `_check_can_step`, openenv_service.py's `_cannot_step`) word it their way."""
    last = session.task
    if last is None:
        return None
    if not last.done():
        return "running"
    if last.cancelled() or last.exception() is not None:
        return "failed"
    if isinstance(last.result(), StepResult) and last.result().done:
        return "done"
    return None
