"""The client of the remote verifier protocol (docs/verifiers.md): score completions with an HTTP service.

Owns: `RemoteVerifier`, which splits samples into batches, sends them to the service's replicas (round-robin, at
most `max_concurrency` requests in flight), enforces a deadline per request, retries transient faults with
full-jitter exponential backoff (what is retried: its docstring), validates every reply, and applies the source's
failure policy (`fail`, `drop`, `default`) to what is still unscored; `RemoteScores` (rewards plus metrics);
`RemoteVerifierError`. With `level: steps`, one reward per step (`step_rewards`); with `protocol: openrlhf`,
OpenRLHF's protocol through the same batching, deadlines, retries and failure policy.
Does not own: combining sources into one reward or dropping groups (cluster/run/scoring.py and the driver, from the
`None`s here), nor the service side (rewards/service.py), nor OpenRLHF's request shape (rewards/openrlhf.py), nor
the plumbing shared with the environment clients (rewards/http.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from rewards.http import EventLoopThread, Redacting, RetriesFailed, Retryable, bearer_token, is_finite_number, retrying
from rewards.openrlhf import request_body

if TYPE_CHECKING:  # the config type is only named in annotations
    from rewards.config import RemoteSource

log = logging.getLogger(__name__)

METRIC_KEYS = ("failures", "retries", "requests", "latency_mean_s", "latency_max_s")


class RemoteVerifierError(RuntimeError):
    """A remote verifier source failed under `on_failure=fail`; the message is one line naming source, URL, error.

    `metrics` holds the source's metrics up to the failure (same keys as `RemoteScores.metrics`).
    """

    def __init__(self, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.metrics = metrics or {}


@dataclass(frozen=True)
class VerifierSample:
    """One completion to score; `id` is unique within a `score` call and echoed back by the service."""

    id: str
    prompt: str
    completion: str
    label: Any = None  # any JSON value
    metadata: dict = field(default_factory=dict)  # JSON object passed through to the service
    steps: list[str] | None = None  # the completion's step texts, in order, delimiter removed; sent only if not None
    # `protocol: openrlhf`: the prompt and completion as one text, as OpenRLHF sends it (decoded with the special
    # tokens, EOS included); None: prompt + completion.
    query: str | None = None


@dataclass
class RemoteScores:
    """What `RemoteVerifier.score` returns."""

    rewards: list[float | list[float] | None]
    """One per sample, in the samples' order: a float (`level: outcome`), or the sample's step rewards, one per step
    (`level: steps`: `[default_reward] * len(steps)` when unscored under `on_failure=default`); `None` (only with
    `on_failure=drop`): drop the sample's group."""
    metrics: dict[str, float]
    """`failures` (samples unscored after retries, whatever the policy), `retries`, `requests` (HTTP requests sent,
    retries included), `latency_mean_s` / `latency_max_s` (over requests that got a valid reply; 0 if none)."""


@dataclass
class _Batch:
    index: int
    samples: list[VerifierSample]
    rewards: dict[str, float | list[float]] = field(default_factory=dict)  # id -> reward, or step rewards
    errors: dict[str, str] = field(default_factory=dict)  # id -> why it stayed unscored
    url: str = ""  # the last URL tried


@dataclass
class _Stats:
    requests: int = 0
    retries: int = 0
    latencies: list[float] = field(default_factory=list)

    def metrics(self, failures: int) -> dict[str, float]:
        lat = self.latencies
        return {"failures": float(failures), "retries": float(self.retries), "requests": float(self.requests),
                "latency_mean_s": sum(lat) / len(lat) if lat else 0.0, "latency_max_s": max(lat, default=0.0)}


class RemoteVerifier(Redacting):
    """Scores samples with a remote verifier service; one instance per `reward.sources.<name>` of type remote.

    Usage: `with RemoteVerifier("judge", source) as verifier: scores = verifier.score(samples)`.
    `score` always returns or raises within `deadline_s(len(samples))` seconds.

    Decisions:
    - Requests run on a private asyncio event loop in a daemon thread (`EventLoopThread`) with one
      `httpx.AsyncClient`, so connections are reused across `score` calls and each request gets a hard deadline
      (`asyncio.wait_for`): httpx's own timeouts are per read, so a server that trickles bytes would otherwise hold a
      request for ever. The caller stays synchronous.
    - Retried (the same batch, on the next URL): connection refused or reset, timeouts, 5xx, and a malformed reply
      (not JSON, wrong shape, wrong number of results, unknown / duplicate / missing ids), which we treat as a
      server fault. Not retried: 4xx (the request itself is wrong), and per-sample faults (an `"error"` result, or a
      reward that is not a finite number; with `level: steps`, `step_rewards` missing, of the wrong length or not
      all finite numbers), which a deterministic verifier would repeat. A service too old to know `steps` ignores
      them and answers `reward` only: every sample of it fails with an error saying so, and nothing is retried.
    - OpenRLHF's protocol: a `null` reward is that query's failure (relay's service answers it for a query it could
      not score, with the reason in `errors`): counted and not retried, as an `"error"` result. A reply that is not a
      `rewards` list of one finite number or null per query is malformed (retried, then the failure policy). Its
      `scores` and `extra_logs` are ignored: `extra_logs` have no fixed meaning, and relay's metrics are its own
      per-step counters.
    - With `on_failure=fail` the first batch that stays unscored stops the call (the other requests are cancelled),
      so a dead service fails fast; the exception carries the metrics gathered so far.
    - The bearer token is read once, kept only in the client's default headers, and scrubbed from every message; a
      URL that would carry it in clear text (plain http to another machine) is refused unless
      `allow_plain_http_token`. Text from the service is scrubbed whole before it is cut to length (`_excerpt`): cut
      first, a prefix of an echoed token would no longer match and would survive.
    """

    def __init__(self, name: str, config: RemoteSource):
        self.name = name
        self.config = config
        # relay's urls are base URLs (`/verify` is appended); OpenRLHF's are the endpoints themselves.
        self._urls = [url.rstrip("/") if config.protocol == "relay" else url for url in config.urls]
        headers = {"Accept": "application/json"}
        self._secret: str | None = bearer_token(config.token_env, config.urls, config.allow_plain_http_token)
        if self._secret:
            headers["Authorization"] = f"Bearer {self._secret}"
        self._loop = EventLoopThread(f"relay-verifier-{name}")
        self._closed = False
        limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
        self._client: httpx.AsyncClient = self._loop.run(self._make_client(headers, limits), timeout=30)
        self._semaphore = asyncio.Semaphore(config.max_concurrency)

    async def _make_client(self, headers: dict[str, str], limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(self.config.timeout),
                                 verify=self.config.verify_tls, follow_redirects=False)

    def __repr__(self) -> str:
        return (f"RemoteVerifier(name={self.name!r}, urls={self._urls!r}, on_failure={self.config.on_failure!r}, "
                f"token={'<from $' + self.config.token_env + '>' if self.config.token_env else None})")

    def __enter__(self) -> RemoteVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections and stop the private event loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop(self._client.aclose)

    def deadline_s(self, num_samples: int) -> float:
        """Upper bound on the wall time of `score(num_samples samples)`, in seconds.

        A batch's own attempts take at most (R+1) x timeout plus R backoffs; it can only wait for a free slot
        while every slot is busy, which all requests together fill for at most ceil(requests / concurrency) x
        timeout.
        """
        c = self.config
        batches = math.ceil(num_samples / c.batch_size)
        waves = math.ceil(batches * (c.max_retries + 1) / c.max_concurrency)
        return (c.max_retries + 1) * c.timeout + c.max_retries * c.backoff_max + waves * c.timeout

    def score(self, samples: list[VerifierSample]) -> RemoteScores:
        """Rewards for `samples` (same order) under the source's failure policy, and this call's metrics."""
        if self._closed:
            raise RuntimeError(f"verifier '{self.name}' is closed")
        ids = [s.id for s in samples]
        if len(set(ids)) != len(ids):
            raise ValueError(f"verifier '{self.name}': sample ids must be unique within one score call")
        if self.config.level == "steps":
            unsplit = next((s.id for s in samples if s.steps is None), None)
            if unsplit is not None:
                raise ValueError(f"verifier '{self.name}' has level 'steps': sample {unsplit!r} has no steps; give "
                                 "every sample its step texts (VerifierSample.steps)")
        if not samples:
            return RemoteScores([], _Stats().metrics(0))
        size = self.config.batch_size
        batches = [_Batch(i, samples[start:start + size]) for i, start in enumerate(range(0, len(samples), size))]
        stats = _Stats()
        deadline = self.deadline_s(len(samples))
        try:
            self._loop.run(self._score_batches(batches, stats), timeout=deadline + 5)
        except TimeoutError:  # the bound above should make this unreachable; never hang if it is wrong
            raise RemoteVerifierError(self._scrub(f"verifier '{self.name}' did not finish within {deadline + 5:.0f}s "
                                                  "(client bug: please report)"), stats.metrics(len(samples))) from None
        return self._apply_policy(batches, stats)

    async def _score_batches(self, batches: list[_Batch], stats: _Stats) -> None:
        tasks = [asyncio.create_task(self._score_batch(b, stats)) for b in batches]
        try:
            if self.config.on_failure != "fail":
                await asyncio.gather(*tasks)
                return
            for done in asyncio.as_completed(tasks):  # stop at the first batch that stays unscored
                batch = await done
                if batch.errors:
                    return
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _score_batch(self, batch: _Batch, stats: _Stats) -> _Batch:
        """Send one batch, retrying transient faults on the next URL; fill `batch.rewards` / `batch.errors`."""
        c = self.config

        async def attempt(k: int) -> None:
            batch.url = self._urls[(batch.index + k) % len(self._urls)]
            async with self._semaphore:
                stats.requests += 1
                start = time.perf_counter()
                results = await asyncio.wait_for(self._post(batch), timeout=c.timeout)
                stats.latencies.append(time.perf_counter() - start)
            self._read_results(batch, results)

        def retried(reason: str, delay: float) -> None:
            stats.retries += 1
            log.debug("verifier '%s' at %s: %s; retry in %.2fs", self.name, batch.url, self._scrub(reason), delay)

        try:
            await retrying(attempt, max_retries=c.max_retries, backoff=c.backoff, backoff_max=c.backoff_max,
                           timeout=c.timeout, on_retry=retried)
        except RetriesFailed as err:
            batch.errors = {s.id: str(err) for s in batch.samples}
            log.warning("verifier '%s' at %s: %d samples unscored: %s", self.name, batch.url, len(batch.samples),
                        self._scrub(str(err)))
        return batch

    async def _post(self, batch: _Batch) -> list:
        """POST the batch; return the reply's `results` list if the reply is well formed, else raise."""
        if self.config.protocol == "openrlhf":
            return await self._post_openrlhf(batch)
        body = {"samples": [_sample_body(s) for s in batch.samples]}
        reply = self._json_reply(await self._client.post(f"{batch.url}/verify", json=body), self.config.token_env)
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise Retryable('malformed reply: expected {"results": [{"id": ..., "reward": ...}, ...]}')
        self._check_ids(batch, results)
        return results

    async def _post_openrlhf(self, batch: _Batch) -> list[dict]:
        """POST the batch in OpenRLHF's shape; return its rewards as relay's results (`{"id", "reward"}`, in order;
        `{"id", "error"}` for a null reward) if the reply holds one finite number or null per query, else raise
        `Retryable` (malformed)."""
        samples = batch.samples
        body = request_body([s.query if s.query is not None else s.prompt + s.completion for s in samples],
                            [s.prompt for s in samples], [s.label for s in samples])
        reply = self._json_reply(await self._client.post(batch.url, json=body), self.config.token_env)
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, list):
            raise Retryable('malformed reply: expected {"rewards": [one number per query, ...]}')
        if len(rewards) != len(samples):
            raise Retryable(f"malformed reply: {len(rewards)} rewards for {len(samples)} queries")
        bad = next((i for i, r in enumerate(rewards) if r is not None and not is_finite_number(r)), None)
        if bad is not None:
            raise Retryable(f"malformed reply: reward {bad} is {self._excerpt(json.dumps(rewards[bad]), 50)}, not a "
                            "finite number")
        errors = reply.get("errors")
        errors = errors if isinstance(errors, list) and len(errors) == len(samples) else [None] * len(samples)
        return [{"id": s.id, "reward": r} if r is not None else
                {"id": s.id, "error": e if isinstance(e, str) and e else "the service returned no reward (null)"}
                for s, r, e in zip(samples, rewards, errors)]

    def _read_results(self, batch: _Batch, results: list[dict]) -> None:
        steps = {s.id: s.steps for s in batch.samples}
        for result in results:
            sid, error = result["id"], result.get("error")
            if error is not None:
                batch.errors[sid] = f"sample {sid!r}: service error: {self._excerpt(str(error), 200)}"
                continue
            if self.config.level == "steps":
                value, problem = self._step_rewards(result, len(steps[sid] or ()))  # `score` checked they are set
            else:
                value, problem = self._reward(result)
            if problem:
                batch.errors[sid] = f"sample {sid!r}: {problem}"
            else:
                batch.rewards[sid] = value

    def _reward(self, result: dict) -> tuple[float, str]:
        """(reward, "") from a result of `level: outcome`, or (0.0, why it is not a reward)."""
        reward = result.get("reward")
        if not is_finite_number(reward):
            if reward is None and "step_rewards" in result:
                return 0.0, "the service returned step_rewards but no reward: set level=steps, or send no steps"
            return 0.0, f"reward {self._excerpt(json.dumps(reward), 50)} is not a finite number"
        return float(reward), ""

    def _step_rewards(self, result: dict, num_steps: int) -> tuple[list[float], str]:
        """(step rewards, "") from a result of `level: steps`, or ([], why they are not one finite number per step)."""
        rewards = result.get("step_rewards")
        if rewards is None:
            return [], ("the service returned no step_rewards: it probably does not support steps (docs/verifiers.md, "
                        "--step-verifier)")
        if not isinstance(rewards, list):
            return [], f"step_rewards {self._excerpt(json.dumps(rewards), 50)} is not a list"
        if len(rewards) != num_steps:
            return [], f"{len(rewards)} step_rewards for {num_steps} steps"
        bad = next((i for i, r in enumerate(rewards) if not is_finite_number(r)), None)
        if bad is not None:
            return [], f"step {bad}'s reward {self._excerpt(json.dumps(rewards[bad]), 50)} is not a finite number"
        return [float(r) for r in rewards], ""

    def _apply_policy(self, batches: list[_Batch], stats: _Stats) -> RemoteScores:
        failed = [b for b in batches if b.errors]
        failures = sum(len(b.errors) for b in failed)
        metrics = stats.metrics(failures)
        if failed and self.config.on_failure == "fail":
            first = failed[0]
            reason = next(iter(first.errors.values()))
            more = f" ({failures} samples unscored)" if failures > 1 else ""
            raise RemoteVerifierError(self._scrub(f"verifier '{self.name}' at {first.url} failed: {reason}{more}"),
                                      metrics)
        rewards: list[float | list[float] | None] = []
        for batch in batches:
            rewards.extend(batch.rewards[s.id] if s.id in batch.rewards else self._fallback(s) for s in batch.samples)
        return RemoteScores(rewards, metrics)

    def _fallback(self, sample: VerifierSample) -> float | list[float] | None:
        """What an unscored sample gets under `drop` (None) or `default` (`default_reward`, for every step)."""
        c = self.config
        if c.on_failure != "default":
            return None
        return [c.default_reward] * len(sample.steps or ()) if c.level == "steps" else c.default_reward


    def _check_ids(self, batch: _Batch, results: list[dict]) -> None:
        """Raise `Retryable` unless the results hold exactly the batch's ids, once each."""
        expected = {s.id for s in batch.samples}
        seen: set[str] = set()
        for result in results:
            sid = result.get("id")
            if not isinstance(sid, str):
                raise Retryable("malformed reply: a result has no string id")
            if sid not in expected:
                raise Retryable(f"malformed reply: result for unknown id {self._excerpt(sid, 50)!r}")
            if sid in seen:
                raise Retryable(f"malformed reply: duplicate result for id {sid[:50]!r}")  # one of ours
            seen.add(sid)
        if len(results) != len(expected):
            missing = next(iter(expected - seen))
            raise Retryable(f"malformed reply: {len(results)} results for {len(expected)} samples "
                             f"(no result for id {missing[:50]!r})")


def _sample_body(sample: VerifierSample) -> dict[str, Any]:
    """One sample as the protocol sends it; `steps` only when the sample has them, so old services see no change."""
    body = {"id": sample.id, "prompt": sample.prompt, "completion": sample.completion, "label": sample.label,
            "metadata": sample.metadata}
    if sample.steps is not None:
        body["steps"] = sample.steps
    return body
