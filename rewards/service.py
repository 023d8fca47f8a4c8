"""The reference verifier service (docs/verifiers.md, "`relay verifier serve`": how it behaves, and why): any
`(completion, label) -> reward` function over HTTP, and any `(steps, label) -> step rewards` function.

Owns: `create_app` (a FastAPI app speaking the remote verifier protocol: `GET /health`, `POST /verify`, optional
bearer token, request limits, per-sample errors and deadlines in a pool of `workers` threads; and OpenRLHF's
`POST /get_reward`, behind the same token, limits, pool and deadlines), `app_from_spec` (the verifiers by name or
`package.module:function`), `run_app` (serve an app with uvicorn: what `relay verifier serve` calls) and
`run_in_thread` (the service on a background thread, for tests and benchmarks); both warn when an app without a token
is served beyond loopback. Also the template for your own service (docs/verifiers.md, "Writing your own service").
Does not own: the verifier functions (rewards/verifiers.py), the client (rewards/remote.py), OpenRLHF's shapes
(rewards/openrlhf.py), nor the plumbing shared with the environment service (rewards/http.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from rewards.config import is_loopback
from rewards.http import (
    BrowserGuard,
    allowed_origins,
    authorized,
    guard_docs,
    read_body,
    token_from_env,
    unauthorized,
)
from rewards.openrlhf import DEFAULT_SPECIAL_TOKENS, RewardRequest, completion_of, longest_first, reward_reply

log = logging.getLogger(__name__)

Verifier = Callable[[str, Any], float]
"""A reward function: (completion, label) -> reward."""

StepVerifier = Callable[[list[str], Any], list[float]]
"""A process reward function: (the completion's step texts, label) -> one reward per step."""

VERIFIER_RAISED = "verifier raised an exception; see the service's log"
"""The `error` a client gets for a sample whose verifier call raised."""

STEPS_ONLY = "this service scores steps only: send steps"
"""The `error` a client gets for a sample without `steps` from a service that has only a step verifier."""


class Sample(BaseModel):
    """One completion to score."""

    model_config = ConfigDict(extra="ignore")
    id: str
    prompt: str
    completion: str
    label: Any = None
    metadata: dict[str, Any] = {}
    steps: list[str] | None = None
    """The completion's step texts, in order, delimiter removed; scored by the step verifier if there is one."""


class VerifyRequest(BaseModel):
    """Body of `POST /verify`."""

    model_config = ConfigDict(extra="ignore")
    samples: list[Sample]


class Result(BaseModel):
    """One sample's outcome: `reward` (or `step_rewards`, one per step, for a sample with steps scored by the step
    verifier), or `error` when it could not be scored."""

    id: str
    reward: float | None = None
    step_rewards: list[float] | None = None
    error: str | None = None


class VerifyResponse(BaseModel):
    """Body of a 200 reply to `POST /verify`: one result per sample (any order)."""

    results: list[Result]


class _StuckCalls:
    """Counts verifier calls still running after their sample's deadline passed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def change(self, delta: int) -> None:
        with self._lock:
            self.count += delta


class _Scoring:
    """One request's samples in the worker pool.

    Each worker records when it starts a sample and resolves it with its result; the request's handler waits for
    all of them and resolves a sample that has run past its deadline with an error. Whichever comes first wins.
    One pool task and no event-loop round trip per sample, so the service's own cost stays per request (JSON, HTTP,
    thread hand-off: docs/benchmarks.md, client throughput).
    """

    def __init__(self, verifiers: _Verifiers, samples: list[Sample], timeout: float, stuck: _StuckCalls):
        self.verifiers, self.samples, self.timeout, self.stuck = verifiers, samples, timeout, stuck
        self.started: list[float | None] = [None] * len(samples)  # monotonic start time of each call
        self.results: list[Result | None] = [None] * len(samples)
        self._pending = len(samples)
        self._lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()

    def _resolve(self, i: int, result: Result) -> bool:
        """Record sample i's result unless it already has one; thread-safe."""
        with self._lock:
            if self.results[i] is not None:
                return False
            self.results[i] = result
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._loop.call_soon_threadsafe(lambda: self._done.done() or self._done.set_result(None))
        return True

    def run(self, i: int) -> None:
        """Score sample i (in a worker thread)."""
        self.started[i] = time.monotonic()
        sample = self.samples[i]
        try:
            result = self.verifiers.score(sample)
        except Exception:  # the detail stays in this service's log; the client learns only that it failed
            log.exception("sample %r: the verifier raised", sample.id)
            result = Result(id=sample.id, error=VERIFIER_RAISED)
        if not self._resolve(i, result):  # it had timed out: this worker is free again
            self.stuck.change(-1)

    async def wait(self) -> list[Result]:
        """Every sample's result, resolving those past their deadline (counted from their start) as errors."""
        while not self._done.done():
            now, next_check = time.monotonic(), self.timeout  # samples not started yet: look again later
            for i, start in enumerate(self.started):
                if start is None or self.results[i] is not None:
                    continue
                if now - start < self.timeout:
                    next_check = min(next_check, start + self.timeout - now)
                elif self._resolve(i, Result(id=self.samples[i].id,
                                             error=f"verifier took longer than sample_timeout={self.timeout:g}s")):
                    self.stuck.change(+1)
            if not self._done.done():
                await asyncio.wait([self._done], timeout=next_check)
        return self.results  # type: ignore[return-value]  # all resolved


class _Verifiers:
    """The service's outcome verifier and step verifier (either may be None, not both); picks one per sample."""

    def __init__(self, verifier: Verifier | None, step_verifier: StepVerifier | None):
        if verifier is None and step_verifier is None:
            raise ValueError("give a verifier, a step verifier, or both")
        self.verifier, self.step_verifier = verifier, step_verifier

    def score(self, sample: Sample) -> Result:
        """The sample's result; raises what the verifier raises."""
        if sample.steps is not None and self.step_verifier is not None:
            return _step_result(sample.id, self.step_verifier(sample.steps, sample.label), len(sample.steps))
        if self.verifier is None:
            return Result(id=sample.id, error=STEPS_ONLY)
        return _result(sample.id, self.verifier(sample.completion, sample.label))


def _result(sample_id: str, value: Any) -> Result:
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return Result(id=sample_id, error=f"verifier returned {type(value).__name__}, not a number")
    if not math.isfinite(reward):
        return Result(id=sample_id, error=f"verifier returned {reward}, not a finite number")
    return Result(id=sample_id, reward=reward)


def _step_result(sample_id: str, value: Any, num_steps: int) -> Result:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        return Result(id=sample_id, error=f"step verifier returned {type(value).__name__}, not a list of numbers")
    try:
        rewards = [float(v) for v in value]
    except (TypeError, ValueError):
        return Result(id=sample_id, error="step verifier returned a list holding something that is not a number")
    if len(rewards) != num_steps:
        return Result(id=sample_id, error=f"step verifier returned {len(rewards)} rewards for {num_steps} steps")
    bad = next((r for r in rewards if not math.isfinite(r)), None)
    if bad is not None:
        return Result(id=sample_id, error=f"step verifier returned {bad}, not a finite number")
    return Result(id=sample_id, step_rewards=rewards)


def create_app(verifier: Verifier | None = None, *, step_verifier: StepVerifier | None = None, max_batch: int = 1024,
               max_body_bytes: int = 8 * 2**20, workers: int = 4, sample_timeout: float = 30.0,
               token: str | None = None, special_tokens: Sequence[str] | None = None,
               allow_origins: Sequence[str] = ()) -> FastAPI:
    """A FastAPI app serving `verifier` and/or `step_verifier` (at least one) with the remote verifier protocol, and
    `verifier` with OpenRLHF's (`POST /get_reward`).

    A sample with `steps` is scored by `step_verifier` (result `step_rewards`), or by `verifier` on its completion
    when there is no step verifier (result `reward`); a sample without `steps` needs `verifier`.
    max_batch: most samples (or queries) per request (more: 413). max_body_bytes: largest request body (more: 413).
    workers: threads scoring samples in parallel. sample_timeout: seconds one call may run before its sample gets
    an error. token: bearer token required by `/verify`, `/get_reward` and FastAPI's `/openapi.json`, `/docs` and
    `/redoc` (None: no authentication).
    special_tokens: stripped from a `/get_reward` query's completion (None: `rewards.openrlhf.DEFAULT_SPECIAL_TOKENS`).
    allow_origins: web pages (`scheme://host[:port]`) allowed to call the service from a browser; every other
    `Origin` is refused, as are POSTs not declared `application/json` and, on loopback, other hosts' names
    (rewards/http.py's `BrowserGuard`).

    Long because the app's route table reads in one place: the routes are closures over its state (the verifiers,
    the pool, the token), each a few lines, written where FastAPI registers them."""
    if max_batch < 1 or max_body_bytes < 1 or workers < 1 or not sample_timeout > 0:
        raise ValueError("max_batch, max_body_bytes, workers and sample_timeout must be positive")
    origins = allowed_origins(allow_origins)
    verifiers = _Verifiers(verifier, step_verifier)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="relay-verify")
    stuck = _StuckCalls()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="relay verifier service", lifespan=lifespan,
                  description="The remote verifier protocol of relay (`/verify`), and OpenRLHF's "
                              "(`/get_reward`): docs/verifiers.md.")
    app.state.requires_token = token is not None  # read by run_app / run_in_thread to warn about open services
    app.add_middleware(BrowserGuard, allowed=origins, serve_command="relay verifier serve")

    async def score(samples: list[Sample]) -> list[Result]:
        """Every sample's result, from the worker pool under the per-sample deadline (both routes)."""
        return await _score(verifiers, samples, pool, sample_timeout, stuck)

    @app.get("/health")
    async def health():
        if stuck.count >= workers:
            return JSONResponse({"status": "stalled", "detail": f"all {workers} workers are held by calls that "
                                 f"exceeded sample_timeout={sample_timeout:g}s"}, status_code=503)
        return {"status": "ok"}

    @app.post("/verify", response_model=VerifyResponse, response_model_exclude_none=True,
              responses={401: {"description": "missing or wrong bearer token"},
                         413: {"description": "body larger than max_body_bytes or more samples than max_batch"},
                         422: {"description": "body is not a valid request"}})
    async def verify(request: Request):
        body = await _admit(request, VerifyRequest, token, max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        samples = body.samples
        if len(samples) > max_batch:
            return _error(413, f"{len(samples)} samples exceed max_batch={max_batch}; send smaller batches "
                               "(client: batch_size)")
        if len({s.id for s in samples}) != len(samples):
            return _error(422, "sample ids must be unique within a request")
        results = await score(samples)
        failed = [r for r in results if r.error is not None]
        if failed:
            log.warning("%d of %d samples unscored; first: %s: %s", len(failed), len(results), failed[0].id,
                        failed[0].error)
        return VerifyResponse(results=results)

    strip = longest_first(DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    mismatch_logged = threading.Event()

    @app.post("/get_reward", responses=GET_REWARD_RESPONSES)
    async def get_reward(request: Request):
        """OpenRLHF's remote reward protocol (rewards/openrlhf.py, docs/verifiers.md)."""
        body = await _admit(request, RewardRequest, token, max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        if len(body.query) > max_batch:
            return _error(413, f"{len(body.query)} queries exceed max_batch={max_batch}; send smaller batches")
        if verifiers.verifier is None:
            return JSONResponse({"detail": "this service has only a step verifier; /get_reward scores whole "
                                           "completions: serve it with --verifier", "retryable": False},
                                status_code=501)
        return await _openrlhf_rewards(body, score, strip, mismatch_logged)

    guard_docs(app, token)
    return app


GET_REWARD_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "missing or wrong bearer token"},
    413: {"description": "body larger than max_body_bytes or more queries than max_batch"},
    422: {"description": "body is not a valid request, or prompts / labels do not hold one entry per query"},
    500: {"description": "no query could be scored; `retryable: false`"},
    501: {"description": "this service has only a step verifier"}}


async def _openrlhf_rewards(body: RewardRequest, score: Callable[[list[Sample]], Awaitable[list[Result]]],
                            strip: Sequence[str], mismatch_logged: threading.Event) -> Any:
    """The reply to a `/get_reward` request that passed the shared checks: a 200 with one reward per query (null,
    and its error in `errors`, for a query that could not be scored), a 422 when `prompts` / `labels` do not line up,
    or a 500 (not retryable) naming the first query when none could be scored."""
    if (problem := body.problem()) is not None:
        return _error(422, problem)
    queries = body.query
    prompts, labels = body.prompts or [None] * len(queries), body.labels or [None] * len(queries)
    texts = [_completion(query, prompt, strip) for query, prompt in zip(queries, prompts)]
    found = [i for i, text in enumerate(texts) if not isinstance(text, str)]  # a str: why it holds no completion
    scored = await score([Sample(id=str(i), prompt=prompts[i] or "", completion=texts[i][0], label=labels[i])
                          for i in found])
    results = [Result(id=str(i), error=text) if isinstance(text, str) else None for i, text in enumerate(texts)]
    for i, result in zip(found, scored):
        results[i] = result
    failed = [i for i, r in enumerate(results) if r.error is not None]
    if failed:
        first = failed[0]
        log.warning("/get_reward: %d of %d queries unscored; first: %d: %s", len(failed), len(results), first,
                    results[first].error)
    if failed and len(failed) == len(results):
        return JSONResponse({"detail": f"no query could be scored: query {first}: {results[first].error} "
                                       f"({len(failed)} of {len(results)} failed)", "retryable": False},
                            status_code=500)
    mismatched = [not isinstance(text, str) and not text[1] for text in texts]
    if any(mismatched) and not mismatch_logged.is_set():  # once: OpenRLHF sends one query per request
        mismatch_logged.set()
        log.warning("/get_reward: query %d does not start with its prompt as sent: scored after the end of it that "
                    "starts it; such queries are flagged in extra_logs.prompt_mismatch", mismatched.index(True))
    reply = reward_reply([r.reward for r in results], mismatched)  # an unscored query's reward is null
    if failed:
        reply["errors"] = [r.error for r in results]
    return reply


def _completion(query: str, prompt: str | None, strip: Sequence[str]) -> tuple[str, bool] | str:
    """`completion_of`'s (completion, found whole), or, for a query that does not hold its prompt, why: that query's
    error (a fixed sentence, nothing of the query)."""
    try:
        return completion_of(query, prompt, strip)
    except ValueError as err:
        return str(err)


async def _score(verifiers: _Verifiers, samples: list[Sample], pool: ThreadPoolExecutor, timeout: float,
                 stuck: _StuckCalls) -> list[Result]:
    if not samples:
        return []
    scoring = _Scoring(verifiers, samples, timeout, stuck)
    futures = [pool.submit(scoring.run, i) for i in range(len(samples))]
    try:
        return await scoring.wait()
    finally:
        for future in futures:  # a no-op once started; frees the queue if the request was abandoned
            future.cancel()


Body = TypeVar("Body", bound=BaseModel)


async def _admit(request: Request, model: type[Body], token: str | None, max_body_bytes: int) -> Body | JSONResponse:
    """The request's body read as `model`, or the reply refusing it: 401 (token), 413 (body size) or 422 (shape,
    with the field's location). What every scoring route checks first."""
    if token is not None and not authorized(request, token):
        return unauthorized()
    body = await read_body(request, max_body_bytes)
    if body is None:
        return _error(413, f"request body exceeds max_body_bytes={max_body_bytes}; send smaller batches")
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        detail = err.errors(include_url=False, include_input=False, include_context=False)
        return JSONResponse({"detail": jsonable_encoder(detail)}, status_code=422)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def app_from_spec(spec: str | None, *, params: Mapping[str, Any] | None = None, step_spec: str | None = None,
                  step_params: Mapping[str, Any] | None = None, token_env: str | None = None,
                  tokenizer: str | None = None, **options: Any) -> FastAPI:
    """`create_app` for the verifier named `spec` and/or the step verifier named `step_spec` (registry names or
    `package.module:function`; at least one), with `params` / `step_params` bound.

    The token, if any, is read from the environment variable `token_env`; `/get_reward` strips the special tokens of
    the tokenizer at `tokenizer` (a directory or Hugging Face name; None: the default list). Raises ValueError (one
    line) for no or an unknown verifier, an unset token variable, a tokenizer that does not load or a bad option.
    """
    from rewards.openrlhf import special_tokens_from
    from rewards.registry import load_verifier

    verifier = load_verifier(spec, params) if spec is not None else None
    step_verifier = load_verifier(step_spec, step_params, steps=True) if step_spec is not None else None
    special_tokens = special_tokens_from(tokenizer) if tokenizer is not None else None
    return create_app(verifier, step_verifier=step_verifier, token=token_from_env(token_env),
                      special_tokens=special_tokens, **options)


def run_app(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` on host:port (loopback by default) with uvicorn until interrupted; what `relay verifier serve`
    runs. Warns when an app from `create_app` without a token is served beyond loopback."""
    import uvicorn

    _warn_if_open(app, host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def _warn_if_open(app: Any, host: str) -> None:
    state = getattr(app, "state", None)
    if getattr(state, "requires_token", True) or is_loopback(host):
        return  # apps not made by create_app (no `requires_token`) manage their own access
    command = getattr(state, "serve_command", "relay verifier serve")  # the environment service sets its own
    log.warning("serving on %s without a token: anyone who can reach it can use it; set a token (%s --token-env VAR) "
                "or bind 127.0.0.1", host, command)


@contextmanager
def run_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 10.0) -> Iterator[str]:
    """Serve `app` on a background thread; yield its base URL (port 0 picks a free port); stop it on exit."""
    import uvicorn

    _warn_if_open(app, host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=timeout))
    thread = threading.Thread(target=server.run, name="relay-verifier-service", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"verifier service did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout)
