"""The remote verifier client (rewards/remote.py) against the real reference service (rewards/service.py) on
loopback: results, load spreading, every fault the protocol names under each failure policy, authentication, the
service's own limits, and that `score` always returns or raises within its bound.

Services run with uvicorn on a background thread (`run_in_thread`), and once as the real `relay verifier serve`
subprocess. Client configs use small timeouts and backoffs so the whole file runs in seconds.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from cluster.demo.task import exact_match
from rewards.config import RemoteSource
from rewards.remote import RemoteVerifier, RemoteVerifierError, VerifierSample
from rewards.service import app_from_spec, create_app, run_in_thread

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]
TOKEN = "tok-5f3a9c-secret"


def source(urls: list[str], **overrides) -> RemoteSource:
    """A client config with quick timeouts: 3 retries within ~0.1 s of backoff."""
    fields = dict(type="remote", urls=urls, batch_size=8, max_concurrency=4, timeout=2.0, max_retries=3,
                  backoff=0.01, backoff_max=0.04)
    return RemoteSource(**{**fields, **overrides})


def make_samples(n: int) -> list[VerifierSample]:
    """Samples `i+1=` whose completion is right for even i and wrong for odd i."""
    return [VerifierSample(id=f"s{i}", prompt=f"{i}+1=", completion=str(i + 1 if i % 2 == 0 else i), label=str(i + 1),
                           metadata={"i": i}) for i in range(n)]


def expected(samples: list[VerifierSample]) -> list[float]:
    return [exact_match(s.completion, s.label) for s in samples]


def score_timed(verifier: RemoteVerifier, samples: list[VerifierSample]):
    """(scores or the raised RemoteVerifierError, elapsed seconds); asserts the call kept within its bound."""
    start = time.perf_counter()
    try:
        outcome = verifier.score(samples)
    except RemoteVerifierError as err:
        outcome = err
    elapsed = time.perf_counter() - start
    assert elapsed < verifier.deadline_s(len(samples)), (elapsed, verifier.deadline_s(len(samples)))
    return outcome, elapsed


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def fake_service(reply) -> FastAPI:
    """A service whose `/verify` answers `reply(request samples)`: a Response, or a JSON-able reply body."""
    app = FastAPI()
    app.state.calls = 0

    @app.post("/verify")
    async def verify(request: Request):
        app.state.calls += 1
        out = reply((await request.json())["samples"], request)
        return out if isinstance(out, Response) else JSONResponse(out)

    return app


class FailFirst:
    """ASGI wrapper: answer the first `n` requests to /verify with HTTP `status`, then pass through to `app`."""

    def __init__(self, app, n: int, status: int = 500):
        self.app, self.left, self.status, self.failed = app, n, status, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/verify" and self.left > 0:
            self.left -= 1
            self.failed += 1
            await JSONResponse({"detail": "injected fault"}, status_code=self.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def service_url():
    with run_in_thread(create_app(exact_match)) as url:
        yield url


def test_rewards_match_the_verifier_in_order_and_replicas_share_the_load():
    calls = {"a": 0, "b": 0}

    def counting(replica):
        def verifier(completion, label):
            calls[replica] += 1
            return exact_match(completion, label)
        return verifier

    samples = make_samples(100)
    with run_in_thread(create_app(counting("a"))) as url_a, run_in_thread(create_app(counting("b"))) as url_b:
        with RemoteVerifier("judge", source([url_a, url_b], batch_size=10)) as verifier:
            scores, _ = score_timed(verifier, samples)
            again, _ = score_timed(verifier, samples[::-1])  # connections are reused across calls
    assert scores.rewards == expected(samples) and again.rewards == expected(samples[::-1])
    assert calls["a"] == calls["b"] == 100  # 10 batches per call, alternating between the two replicas
    assert scores.metrics["failures"] == 0 and scores.metrics["retries"] == 0 and scores.metrics["requests"] == 10
    assert 0 < scores.metrics["latency_mean_s"] <= scores.metrics["latency_max_s"] < 2.0


def test_no_samples_sends_nothing(service_url):
    with RemoteVerifier("judge", source([service_url])) as verifier:
        scores = verifier.score([])
    assert scores.rewards == [] and scores.metrics["requests"] == 0


def test_duplicate_sample_ids_are_a_caller_error(service_url):
    sample = make_samples(1)[0]
    with RemoteVerifier("judge", source([service_url])) as verifier, pytest.raises(ValueError, match="unique"):
        verifier.score([sample, sample])


@pytest.mark.parametrize("policy", ["fail", "drop", "default"])
def test_service_down_follows_the_policy(policy):
    url = closed_port_url()
    samples = make_samples(16)  # 2 batches of 8
    config = source([url], on_failure=policy, default_reward=-1.0 if policy == "default" else None)
    with RemoteVerifier("judge", config) as verifier:
        outcome, elapsed = score_timed(verifier, samples)
    assert elapsed < 2.0
    if policy == "fail":
        assert isinstance(outcome, RemoteVerifierError)
        assert str(outcome).startswith(f"verifier 'judge' at {url} failed: 3 retries exhausted: connection refused")
        assert "\n" not in str(outcome) and outcome.metrics["failures"] >= 8 and outcome.metrics["retries"] >= 3
        return
    assert outcome.rewards == ([None] * 16 if policy == "drop" else [-1.0] * 16)
    assert outcome.metrics["failures"] == 16
    assert outcome.metrics["retries"] == 2 * 3 and outcome.metrics["requests"] == 2 * 4  # 2 batches x (1 + 3)


def test_a_dead_replica_is_skipped_by_the_retry(service_url):
    samples = make_samples(32)
    with RemoteVerifier("judge", source([closed_port_url(), service_url])) as verifier:
        scores, _ = score_timed(verifier, samples)
    assert scores.rewards == expected(samples)
    assert scores.metrics["failures"] == 0 and scores.metrics["retries"] == 2  # batches 0 and 2 went to the dead one


@pytest.mark.parametrize("policy", ["fail", "default"])
def test_reply_slower_than_the_deadline_follows_the_policy(policy):
    release, replied = threading.Event(), []

    def slow(completion, label):  # replies only once the client has given up
        release.wait(30)
        replied.append(label)
        return 1.0

    samples = make_samples(2)
    with run_in_thread(create_app(slow)) as url:
        config = source([url], on_failure=policy, default_reward=0.5 if policy == "default" else None, timeout=0.2,
                        max_retries=1)
        with RemoteVerifier("judge", config) as verifier:
            outcome, elapsed = score_timed(verifier, samples)
        replied_before = list(replied)
        release.set()
    assert replied_before == [] and elapsed >= 2 * 0.2  # 2 attempts of 0.2 s, not the verifier's reply
    if policy == "fail":
        assert isinstance(outcome, RemoteVerifierError)
        assert str(outcome) == f"verifier 'judge' at {url} failed: 1 retries exhausted: no reply within " \
                               "timeout=0.2s (2 samples unscored)"
        assert outcome.metrics["failures"] == 2
    else:
        assert outcome.rewards == [0.5] * 2
        assert outcome.metrics["failures"] == 2 and outcome.metrics["retries"] == 1


def test_5xx_is_retried_until_it_succeeds():
    flaky = FailFirst(create_app(exact_match), n=2, status=503)
    samples = make_samples(8)  # one batch
    with run_in_thread(flaky) as url, RemoteVerifier("judge", source([url])) as verifier:
        scores, _ = score_timed(verifier, samples)
    assert scores.rewards == expected(samples)
    assert flaky.failed == 2 and scores.metrics["retries"] == 2 and scores.metrics["requests"] == 3
    assert scores.metrics["failures"] == 0


@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_5xx_forever_follows_the_policy(policy):
    broken = FailFirst(create_app(exact_match), n=10**6, status=500)
    samples = make_samples(8)
    with run_in_thread(broken) as url, RemoteVerifier("judge", source([url], on_failure=policy)) as verifier:
        outcome, elapsed = score_timed(verifier, samples)
    assert elapsed < 2.0 and broken.failed == 4  # 1 + 3 retries
    if policy == "fail":
        assert isinstance(outcome, RemoteVerifierError) and outcome.metrics["failures"] == 8
        assert f"verifier 'judge' at {url} failed: 3 retries exhausted: HTTP 500: " in str(outcome)
    else:
        assert outcome.rewards == [None] * 8
        assert outcome.metrics["failures"] == 8 and outcome.metrics["retries"] == 3


def _results(samples, reward=1.0):
    return [{"id": s["id"], "reward": reward} for s in samples]


# (case, reply(samples) -> body, retried?, ids that stay unscored (None: all), message)
BAD_REPLIES = [
    ("not json", lambda s: Response("<html>oops</html>", media_type="text/html"), True, None, "not JSON"),
    ("wrong shape", lambda s: {"rewards": [1.0] * len(s)}, True, None, 'expected {"results"'),
    ("too few results", lambda s: {"results": _results(s)[:-1]}, True, None, "7 results for 8 samples"),
    ("too many results", lambda s: {"results": _results(s) + _results(s)[:1]}, True, None, "duplicate result"),
    ("unknown id", lambda s: {"results": _results(s)[:-1] + [{"id": "zzz", "reward": 1.0}]}, True, None,
     "unknown id 'zzz'"),
    ("no id", lambda s: {"results": [{"reward": 1.0}] * len(s)}, True, None, "no string id"),
    ("non-numeric reward", lambda s: {"results": _results(s[:-1]) + _results(s[-1:], "1.0")}, False, {"s7"},
     "reward \"1.0\" is not a finite number"),
    ("boolean reward", lambda s: {"results": _results(s[:-1]) + _results(s[-1:], True)}, False, {"s7"},
     "reward true is not a finite number"),
    ("non-finite reward", lambda s: Response(json.dumps({"results": _results(s[:-1]) + _results(s[-1:], float("nan"))}),
                                             media_type="application/json"), False, {"s7"}, "reward NaN"),
    ("neither reward nor error", lambda s: {"results": _results(s[:-1]) + [{"id": s[-1]["id"]}]}, False, {"s7"},
     "reward null"),
]


@pytest.mark.parametrize("case, reply, retried, unscored, message", BAD_REPLIES, ids=[c[0] for c in BAD_REPLIES])
def test_malformed_replies_are_failures(case, reply, retried, unscored, message):
    app = fake_service(lambda samples, request: reply(samples))
    samples = make_samples(8)
    with run_in_thread(app) as url:
        with RemoteVerifier("judge", source([url], on_failure="default", default_reward=-1.0)) as verifier:
            scores, elapsed = score_timed(verifier, samples)
        with RemoteVerifier("judge", source([url], max_retries=0)) as verifier:
            error, _ = score_timed(verifier, samples)
    unscored = unscored if unscored is not None else {s.id for s in samples}
    assert scores.rewards == [-1.0 if s.id in unscored else 1.0 for s in samples]
    assert scores.metrics["failures"] == len(unscored)
    assert scores.metrics["retries"] == (3 if retried else 0) and elapsed < 2.0
    assert isinstance(error, RemoteVerifierError) and message in str(error), str(error)


def test_4xx_is_not_retried():
    app = fake_service(lambda samples, request: JSONResponse({"detail": "bad request"}, status_code=400))
    samples = make_samples(8)
    with run_in_thread(app) as url, RemoteVerifier("judge", source([url])) as verifier:
        error, _ = score_timed(verifier, samples)
    assert isinstance(error, RemoteVerifierError) and app.state.calls == 1
    assert str(error) == f"verifier 'judge' at {url} failed: HTTP 400, not retried: {{\"detail\":\"bad request\"}} " \
                         "(8 samples unscored)"
    assert error.metrics == {"failures": 8.0, "retries": 0.0, "requests": 1.0, "latency_mean_s": 0.0,
                             "latency_max_s": 0.0}


def test_per_sample_errors_fail_only_those_samples_without_retry(caplog):
    def picky(completion, label):
        if label == "4":
            raise ZeroDivisionError("cannot judge 3+1 with /secret/path")
        return exact_match(completion, label)

    samples = make_samples(8)
    with caplog.at_level(logging.WARNING, logger="rewards.service"):
        with run_in_thread(create_app(picky)) as url:
            with RemoteVerifier("judge", source([url], on_failure="drop")) as verifier:
                scores, _ = score_timed(verifier, samples)
            with RemoteVerifier("judge", source([url])) as verifier:
                error, _ = score_timed(verifier, samples)
    assert scores.rewards == [None if s.label == "4" else r for s, r in zip(samples, expected(samples))]
    assert scores.metrics["failures"] == 1 and scores.metrics["retries"] == 0
    assert isinstance(error, RemoteVerifierError)
    # The client gets a generic error; the exception's text, which may hold anything, stays in the service's log.
    assert str(error) == (f"verifier 'judge' at {url} failed: sample 's3': service error: verifier raised an "
                          "exception; see the service's log")
    raised = [r for r in caplog.records if r.name == "rewards.service" and r.exc_info]
    assert len(raised) == 2 and all("'s3'" in r.getMessage() for r in raised)  # once per score call above
    assert all(r.exc_info[0] is ZeroDivisionError and "/secret/path" in str(r.exc_info[1]) for r in raised)


def test_bearer_token_is_required_and_never_shown(monkeypatch):
    samples = make_samples(8)
    with run_in_thread(create_app(exact_match, token=TOKEN)) as url:
        with RemoteVerifier("judge", source([url])) as verifier:
            missing, _ = score_timed(verifier, samples)
        monkeypatch.setenv("JUDGE_TOKEN", "wrong-" + TOKEN)
        with RemoteVerifier("judge", source([url], token_env="JUDGE_TOKEN")) as verifier:
            wrong, _ = score_timed(verifier, samples)
        monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
        with RemoteVerifier("judge", source([url], token_env="JUDGE_TOKEN")) as verifier:
            scores, _ = score_timed(verifier, samples)
            shown = repr(verifier) + str(vars(verifier)["config"]) + json.dumps(scores.metrics)
        health = httpx.get(f"{url}/health")  # load balancers probe without a token
    assert isinstance(missing, RemoteVerifierError) and "HTTP 401, not retried" in str(missing)
    assert missing.metrics["retries"] == 0 and "set token_env" in str(missing)
    assert isinstance(wrong, RemoteVerifierError) and "check the token in $JUDGE_TOKEN" in str(wrong)
    assert TOKEN not in str(wrong) and TOKEN not in repr(wrong)
    assert scores.rewards == expected(samples) and TOKEN not in shown and "JUDGE_TOKEN" in repr(verifier)
    assert health.status_code == 200


def test_a_service_echoing_the_token_does_not_leak_it(monkeypatch):
    echo = fake_service(lambda samples, request: JSONResponse({"detail": request.headers["authorization"]}, 400))
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    with run_in_thread(echo) as url, RemoteVerifier("judge", source([url], token_env="JUDGE_TOKEN")) as verifier:
        error, _ = score_timed(verifier, make_samples(8))
    assert "Bearer ***" in str(error) and TOKEN not in str(error)


def _echo_at(pad: int):
    """Reply text: `pad` characters, then the request's `Authorization` header ("Bearer <token>")."""
    return lambda request: "x" * pad + request.headers["authorization"]


# Replies that put the echoed token across the cut the client makes when it quotes the service: 200 characters of a
# body or a per-sample error, 50 of an id or a reward. Each pad leaves "Bearer " and 8 of the token's characters
# before the cut. (case, reply(samples, request))
STRADDLING_ECHOES = [
    ("4xx body", lambda s, r: PlainTextResponse(_echo_at(200 - 15)(r), status_code=400)),
    ("5xx body", lambda s, r: PlainTextResponse(_echo_at(200 - 15)(r), status_code=503)),
    ("per-sample error", lambda s, r: {"results": [{"id": x["id"], "error": _echo_at(200 - 15)(r)} for x in s]}),
    ("unknown id", lambda s, r: {"results": [{"id": _echo_at(50 - 15)(r), "reward": 1.0} for x in s]}),
    ("reward not a number", lambda s, r: {"results": [{"id": x["id"], "reward": _echo_at(50 - 16)(r)} for x in s]}),
]


@pytest.mark.parametrize("case, reply", STRADDLING_ECHOES, ids=[c[0] for c in STRADDLING_ECHOES])
def test_a_token_echoed_across_the_cut_leaves_no_prefix(monkeypatch, caplog, case, reply):
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG, logger="rewards.remote")  # the retry lines too
    with run_in_thread(fake_service(reply)) as url:
        with RemoteVerifier("judge", source([url], token_env="JUDGE_TOKEN", max_retries=1)) as verifier:
            error, _ = score_timed(verifier, make_samples(2))
        with RemoteVerifier("judge", source([url], token_env="JUDGE_TOKEN", on_failure="drop")) as verifier:
            dropped, _ = score_timed(verifier, make_samples(2))
    assert isinstance(error, RemoteVerifierError) and dropped.rewards == [None, None]
    shown = str(error) + "\n" + "\n".join(r.getMessage() for r in caplog.records)
    assert "Bearer ***" in str(error)  # the echo was quoted, scrubbed ...
    assert [TOKEN[:n] for n in range(4, len(TOKEN) + 1) if TOKEN[:n] in shown] == []  # ... and no prefix survived


@pytest.mark.parametrize("value", [None, ""])
def test_missing_token_variable_names_the_variable(monkeypatch, value):
    monkeypatch.delenv("JUDGE_TOKEN", raising=False)
    if value is not None:
        monkeypatch.setenv("JUDGE_TOKEN", value)
    with pytest.raises(ValueError, match="token_env: environment variable JUDGE_TOKEN is unset or empty"):
        RemoteVerifier("judge", source(["http://127.0.0.1:1"], token_env="JUDGE_TOKEN"))


def test_service_rejects_bad_requests_clearly():
    def body(n: int, completion: str = "1") -> dict:
        return {"samples": [{"id": str(i), "prompt": "p", "completion": completion, "label": "1"} for i in range(n)]}

    app = create_app(exact_match, max_batch=4, max_body_bytes=2000)
    with run_in_thread(app) as url, httpx.Client(base_url=url) as client:
        ok = client.post("/verify", json=body(4))
        empty = client.post("/verify", json=body(0))
        too_many = client.post("/verify", json=body(5))
        too_big = client.post("/verify", json=body(1, "x" * 3000))
        chunks = [json.dumps(body(1, "x" * 3000)).encode()[i:i + 500] for i in range(0, 3100, 500)]
        too_big_chunked = client.post("/verify", content=iter(chunks),  # no Content-Length: counted as it arrives
                                      headers={"content-type": "application/json"})
        missing = client.post("/verify", json={"samples": [{"id": "a", "prompt": "p"}]})
        duplicate = client.post("/verify", json={"samples": [body(1)["samples"][0]] * 2})
        not_json = client.post("/verify", content=b"{", headers={"content-type": "application/json"})
    assert ok.status_code == 200 and ok.json() == {"results": [{"id": str(i), "reward": 1.0} for i in range(4)]}
    assert empty.status_code == 200 and empty.json() == {"results": []}
    assert too_many.status_code == 413 and "5 samples exceed max_batch=4" in too_many.json()["detail"]
    assert too_big.status_code == 413 and "max_body_bytes=2000" in too_big.json()["detail"]
    assert "content-length" not in too_big_chunked.request.headers and too_big_chunked.status_code == 413
    assert missing.status_code == 422
    assert [e["loc"] for e in missing.json()["detail"]] == [["samples", 0, "completion"]]
    assert duplicate.status_code == 422 and "unique" in duplicate.json()["detail"]
    assert not_json.status_code == 422


def test_one_slow_sample_does_not_hold_up_the_others():
    slow = threading.Barrier(3, timeout=10)  # passed only while the three slow samples run at once
    fast, fast_done = [], threading.Event()

    def sometimes_slow(completion, label):
        if label in ("1", "3", "5"):  # each finishes only after the other slow ones started and the rest are scored
            slow.wait()
            if not fast_done.wait(10):
                raise RuntimeError("the fast samples waited for the slow ones")
        else:
            fast.append(label)
            if len(fast) == 29:
                fast_done.set()
        return exact_match(completion, label)

    samples = make_samples(32)
    with run_in_thread(create_app(sometimes_slow, workers=4)) as url:
        with RemoteVerifier("judge", source([url], batch_size=32)) as verifier:
            scores, _ = score_timed(verifier, samples)
    assert scores.rewards == expected(samples) and scores.metrics["failures"] == 0


def test_a_sample_past_sample_timeout_gets_an_error_and_the_rest_are_scored():
    release = threading.Event()

    def hangs_on_one(completion, label):  # hangs until the test is done with the service
        if label == "2":
            release.wait(30)
        return exact_match(completion, label)

    samples = make_samples(8)
    with run_in_thread(create_app(hangs_on_one, workers=2, sample_timeout=0.3)) as url:
        with RemoteVerifier("judge", source([url], on_failure="drop")) as verifier:
            scores, _ = score_timed(verifier, samples)
        stalled = httpx.get(f"{url}/health").status_code
        with RemoteVerifier("judge", source([url], max_retries=0)) as verifier:
            error, _ = score_timed(verifier, samples[1:2])
        release.set()
    # Scored while the hung sample's call still ran: the reply did not wait for it.
    assert scores.rewards == [None if s.label == "2" else r for s, r in zip(samples, expected(samples))]
    assert scores.metrics["failures"] == 1
    assert stalled == 200  # one of the two workers is still held: the replica can still serve
    assert "service error: verifier took longer than sample_timeout=0.3s" in str(error)

    release = threading.Event()
    with run_in_thread(create_app(hangs_on_one, workers=1, sample_timeout=0.1)) as url:
        one = {"id": "a", "prompt": "", "completion": "", "label": "2"}
        stuck = httpx.post(f"{url}/verify", json={"samples": [one]})
        health = httpx.get(f"{url}/health")
        release.set()
    assert stuck.json() == {"results": [{"id": "a", "error": "verifier took longer than sample_timeout=0.1s"}]}
    assert health.status_code == 503 and "all 1 workers are held" in health.json()["detail"]


def test_relay_verifier_serve_cli(serve_verifier, monkeypatch):
    bad = subprocess.run([*RELAY, "verifier", "serve", "--verifier", "no_such_verifier"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("relay: config error: ")
    assert bad.stderr.strip().count("\n") == 0 and "no_such_verifier" in bad.stderr
    bad_param = subprocess.run([*RELAY, "verifier", "serve", "--verifier", "numeric_match", "--param", "tol=1"],
                               capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad_param.returncode == 2 and "does not accept parameter 'tol'" in bad_param.stderr

    process, url = serve_verifier(["--verifier", "cluster.demo.task:exact_match", "--workers", "2", "--token-env",
                                   "SERVE_TOKEN"], {"SERVE_TOKEN": TOKEN})
    samples = make_samples(40)
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    with RemoteVerifier("judge", source([url], token_env="JUDGE_TOKEN")) as verifier:
        scores, _ = score_timed(verifier, samples)
    unauthorized = httpx.post(f"{url}/verify", json={"samples": []})
    assert scores.rewards == expected(samples) and scores.metrics["requests"] == 5
    assert unauthorized.status_code == 401


# Per-step scoring (process supervision): `steps` in the request, `step_rewards` in the reply.


def count_up(steps: list[str], label: int) -> list[float]:
    """A step verifier: step k is right iff it is the number label + k."""
    return [1.0 if step == str(label + k) else 0.0 for k, step in enumerate(steps)]


def make_step_samples(n: int) -> list[VerifierSample]:
    """Sample i counts up from i in i % 3 + 1 steps; for odd i the last step is wrong (-1)."""
    samples = []
    for i in range(n):
        steps = [str(i + k) for k in range(i % 3 + 1)]
        if i % 2:
            steps[-1] = "-1"
        samples.append(VerifierSample(id=f"s{i}", prompt=f"count from {i}:", completion=" ".join(steps), label=i,
                                      steps=steps))
    return samples


def expected_steps(samples: list[VerifierSample]) -> list[list[float]]:
    return [count_up(s.steps, s.label) for s in samples]


def test_step_rewards_round_trip_and_outcome_clients_are_unchanged():
    samples, outcome_samples = make_step_samples(20), make_samples(20)
    with run_in_thread(create_app(exact_match, step_verifier=count_up)) as url:
        with RemoteVerifier("judge", source([url], level="steps")) as verifier:
            scores, _ = score_timed(verifier, samples)
        with RemoteVerifier("judge", source([url])) as verifier:
            outcome, _ = score_timed(verifier, outcome_samples)
    assert scores.rewards == expected_steps(samples)
    assert scores.rewards[:4] == [[1.0], [1.0, 0.0], [1.0, 1.0, 1.0], [0.0]]  # s1: "1", "-1"; s3: "-1"
    assert scores.metrics["failures"] == 0 and scores.metrics["requests"] == 3  # 20 samples in batches of 8
    assert outcome.rewards == expected(outcome_samples) and outcome.metrics["failures"] == 0


def test_steps_are_sent_only_when_given():
    seen: list[list[dict]] = []

    def record(samples, request):
        seen.append(samples)
        return {"results": [{"id": s["id"], "reward": 1.0, "step_rewards": [0.5] * len(s.get("steps", []))}
                            for s in samples]}

    with run_in_thread(fake_service(record)) as url:
        with RemoteVerifier("judge", source([url])) as verifier:
            outcome, _ = score_timed(verifier, make_samples(2))
        with RemoteVerifier("judge", source([url], level="steps")) as verifier:
            steps, _ = score_timed(verifier, make_step_samples(2))
    assert ["steps" in s for s in seen[0]] == [False, False] and outcome.rewards == [1.0, 1.0]
    assert [s["steps"] for s in seen[1]] == [["0"], ["1", "-1"]]
    assert steps.rewards == [[0.5], [0.5, 0.5]]  # `reward` beside `step_rewards` is ignored


def test_a_steps_client_needs_steps_on_every_sample(service_url):
    samples = make_step_samples(3)
    samples[1] = VerifierSample(id="s1", prompt="p", completion="c")
    with RemoteVerifier("judge", source([service_url], level="steps")) as verifier:
        with pytest.raises(ValueError, match="level 'steps': sample 's1' has no steps"):
            verifier.score(samples)


@pytest.mark.parametrize("service", ["old", "no step verifier"])
@pytest.mark.parametrize("policy", ["fail", "drop", "default"])
def test_a_service_without_steps_fails_each_sample_without_retry(service, policy):
    app = (fake_service(lambda samples, request: {"results": _results(samples)}) if service == "old"
           else create_app(exact_match))  # ignores `steps`, scores the completion
    samples = make_step_samples(6)
    with run_in_thread(app) as url:
        config = source([url], level="steps", on_failure=policy, default_reward=-1.0 if policy == "default" else None)
        with RemoteVerifier("judge", config) as verifier:
            outcome, _ = score_timed(verifier, samples)
    if policy == "fail":
        assert isinstance(outcome, RemoteVerifierError)
        assert str(outcome) == (f"verifier 'judge' at {url} failed: sample 's0': the service returned no step_rewards: "
                                "it probably does not support steps (docs/verifiers.md, --step-verifier) (6 samples "
                                "unscored)")
        return
    assert outcome.rewards == ([None] * 6 if policy == "drop" else [[-1.0] * len(s.steps) for s in samples])
    assert outcome.metrics["failures"] == 6 and outcome.metrics["retries"] == 0 and outcome.metrics["requests"] == 1


def _step_results(samples, last):
    """Right-length step rewards for all but the last sample, whose result is `last`."""
    return [{"id": s["id"], "step_rewards": [1.0] * len(s["steps"])} for s in samples[:-1]] + \
        [{"id": samples[-1]["id"], **last}]


# (case, the last sample's result, message); the last of make_step_samples(8) has 2 steps
BAD_STEP_REPLIES = [
    ("too few", {"step_rewards": [1.0]}, "1 step_rewards for 2 steps"),
    ("too many", {"step_rewards": [1.0, 1.0, 1.0]}, "3 step_rewards for 2 steps"),
    ("empty", {"step_rewards": []}, "0 step_rewards for 2 steps"),
    ("not a list", {"step_rewards": 1.0}, "step_rewards 1.0 is not a list"),
    ("non-finite", {"step_rewards": [1.0, float("inf")]}, "step 1's reward Infinity is not a finite number"),
    ("string", {"step_rewards": ["1.0", 1.0]}, "step 0's reward \"1.0\" is not a finite number"),
    ("null", {"step_rewards": [1.0, None]}, "step 1's reward null is not a finite number"),
    ("boolean", {"step_rewards": [True, 1.0]}, "step 0's reward true is not a finite number"),
    ("reward only", {"reward": 1.0}, "the service returned no step_rewards"),
]


@pytest.mark.parametrize("case, last, message", BAD_STEP_REPLIES, ids=[c[0] for c in BAD_STEP_REPLIES])
def test_bad_step_rewards_fail_that_sample_without_retry(case, last, message):
    app = fake_service(lambda samples, request: Response(json.dumps({"results": _step_results(samples, last)}),
                                                         media_type="application/json"))  # json.dumps: inf allowed
    samples = make_step_samples(8)
    with run_in_thread(app) as url:
        config = source([url], level="steps", on_failure="default", default_reward=-1.0)
        with RemoteVerifier("judge", config) as verifier:
            scores, _ = score_timed(verifier, samples)
        with RemoteVerifier("judge", source([url], level="steps")) as verifier:
            error, _ = score_timed(verifier, samples)
    assert scores.rewards == [[1.0] * len(s.steps) for s in samples[:-1]] + [[-1.0, -1.0]]
    assert scores.metrics["failures"] == 1 and scores.metrics["retries"] == 0
    assert isinstance(error, RemoteVerifierError) and app.state.calls == 2
    assert str(error).startswith(f"verifier 'judge' at {url} failed: sample 's7': {message}"), str(error)


def test_service_step_verifier_faults_are_per_sample_errors():
    release = threading.Event()

    def faulty(steps, label):
        if label == 1:
            return [1.0] * (len(steps) + 1)
        if label == 2:
            return [float("nan")] * len(steps)
        if label == 3:
            raise ZeroDivisionError("/secret/path")
        if label == 4:
            return "1.0"
        if label == 5:  # hangs until the test is done with the service
            release.wait(30)
        return count_up(steps, label)

    samples = make_step_samples(8)
    with run_in_thread(create_app(step_verifier=faulty, workers=4, sample_timeout=0.3)) as url:
        with RemoteVerifier("judge", source([url], level="steps", on_failure="drop")) as verifier:
            scores, _ = score_timed(verifier, samples)
        reply = httpx.post(f"{url}/verify", json={"samples": [
            {"id": s.id, "prompt": s.prompt, "completion": s.completion, "label": s.label, "steps": s.steps}
            for s in samples[:6]]})
        release.set()
    assert scores.rewards == [count_up(s.steps, s.label) if s.label in (0, 6, 7) else None for s in samples]
    assert scores.metrics["failures"] == 5 and scores.metrics["retries"] == 0
    assert {r["id"]: r.get("error") for r in reply.json()["results"]} == {
        "s0": None,
        "s1": "step verifier returned 3 rewards for 2 steps",
        "s2": "step verifier returned nan, not a finite number",
        "s3": "verifier raised an exception; see the service's log",
        "s4": "step verifier returned str, not a list of numbers",
        "s5": "verifier took longer than sample_timeout=0.3s",
    }


def test_a_steps_only_service_refuses_samples_without_steps():
    with run_in_thread(create_app(step_verifier=count_up)) as url:
        with RemoteVerifier("judge", source([url], on_failure="drop")) as verifier:
            outcome, _ = score_timed(verifier, make_samples(3))
        with RemoteVerifier("judge", source([url], max_retries=0)) as verifier:
            error, _ = score_timed(verifier, make_samples(1))
        with RemoteVerifier("judge", source([url], level="steps")) as verifier:
            steps, _ = score_timed(verifier, make_step_samples(3))
        with RemoteVerifier("judge", source([url], max_retries=0)) as verifier:  # steps sent, but level outcome
            mismatch, _ = score_timed(verifier, make_step_samples(1))
    assert outcome.rewards == [None] * 3 and outcome.metrics["failures"] == 3 and outcome.metrics["retries"] == 0
    assert steps.rewards == expected_steps(make_step_samples(3))
    assert str(mismatch) == (f"verifier 'judge' at {url} failed: sample 's0': the service returned step_rewards but "
                             "no reward: set level=steps, or send no steps")
    assert str(error) == (f"verifier 'judge' at {url} failed: sample 's0': service error: this service scores steps "
                          "only: send steps")
    with pytest.raises(ValueError, match="give a verifier, a step verifier, or both"):
        app_from_spec(None)
