"""One query that cannot be scored in a batched OpenRLHF `/get_reward` request (rewards/service.py, relay's client in
rewards/remote.py): the service scores the others and answers `null` for it, with its error in `errors`; relay's
client counts it as that sample's failure (never a zero reward), applies the source's policy to it alone and does
not retry it. A request whose every query failed is still a 500 that says so, which OpenRLHF's own client (one
query per request) turns into a sample without a reward."""

from __future__ import annotations

import httpx
import pytest

from rewards.config import RemoteSource
from rewards.remote import RemoteVerifier, RemoteVerifierError, VerifierSample
from rewards.service import VERIFIER_RAISED, create_app, run_in_thread
from tests.actors.test_openrlhf_reward import openrlhf_rewards


def unscorable_at_7(completion: str, label) -> float:
    if completion == "7":
        raise RuntimeError("secret detail")  # stays in the service's log
    return float(completion == label)


def source(url: str, **overrides) -> RemoteSource:
    fields = dict(type="remote", protocol="openrlhf", urls=[f"{url}/get_reward"], batch_size=4, max_concurrency=1,
                  timeout=5.0, max_retries=3, backoff=0.01, backoff_max=0.04)
    return RemoteSource(**{**fields, **overrides})


SAMPLES = [VerifierSample(id=str(i), prompt="q=", completion=c, label="4") for i, c in enumerate(["4", "7", "5", "4"])]


@pytest.mark.parametrize("policy, expected", [("drop", [1.0, None, 0.0, 1.0]), ("default", [1.0, -1.0, 0.0, 1.0])])
def test_one_unscorable_query_leaves_the_rest_of_its_batch_scored(policy, expected):
    extra = {"default_reward": -1.0} if policy == "default" else {}
    with run_in_thread(create_app(unscorable_at_7)) as url:
        with RemoteVerifier("judge", source(url, on_failure=policy, **extra)) as verifier:
            scores = verifier.score(SAMPLES)  # one request of 4 queries
    assert scores.rewards == expected
    assert scores.metrics["failures"] == 1 and scores.metrics["retries"] == 0 and scores.metrics["requests"] == 1


def test_under_fail_the_unscorable_query_is_named():
    with run_in_thread(create_app(unscorable_at_7)) as url:
        with RemoteVerifier("judge", source(url, on_failure="fail")) as verifier:
            with pytest.raises(RemoteVerifierError) as raised:
                verifier.score(SAMPLES)
    assert str(raised.value) == (f"verifier 'judge' at {url}/get_reward failed: sample '1': service error: "
                                 f"{VERIFIER_RAISED}")
    assert raised.value.metrics["failures"] == 1 and raised.value.metrics["retries"] == 0


def test_the_reply_says_which_query_failed_and_openrlhfs_client_reads_it():
    queries, prompts, labels = ["q=4", "q=7", "q=5"], ["q="] * 3, ["4"] * 3
    with run_in_thread(create_app(unscorable_at_7)) as url:
        [reply] = openrlhf_rewards(f"{url}/get_reward", queries, prompts, labels)  # OpenRLHF's own client
        every_one = httpx.post(f"{url}/get_reward", json={"query": ["q=7", "q=7"], "prompts": ["q="] * 2})
    assert reply == {"rewards": [1.0, None, 0.0], "scores": [1.0, None, 0.0],
                     "extra_logs": {"prompt_mismatch": [0.0, 0.0, 0.0]}, "errors": [None, VERIFIER_RAISED, None]}
    assert every_one.status_code == 500 and every_one.json() == {
        "detail": f"no query could be scored: query 0: {VERIFIER_RAISED} (2 of 2 failed)", "retryable": False}


def test_a_null_from_another_server_is_that_samples_failure():
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/get_reward")
    async def get_reward(body: dict):
        rewards = [None if q.endswith("7") else 1.0 for q in body["query"]]
        return {"rewards": rewards, "scores": rewards}

    with run_in_thread(app) as url, RemoteVerifier("judge", source(url, on_failure="drop")) as verifier:
        scores = verifier.score(SAMPLES)
    assert scores.rewards == [1.0, None, 1.0, 1.0]
    assert scores.metrics["failures"] == 1 and scores.metrics["retries"] == 0


def test_a_query_that_does_not_hold_its_prompt_is_that_querys_failure():
    # rewards/openrlhf.py's `completion_of` refuses a query that starts with no end of its prompt (issue 58, item 5).
    with run_in_thread(create_app(unscorable_at_7)) as url:
        reply = httpx.post(f"{url}/get_reward", json={"query": ["q=4", "Legs: 4"], "prompts": ["q=", "How many legs?"],
                                                      "labels": ["4", "4"]})
        with RemoteVerifier("judge", source(url, on_failure="drop")) as verifier:
            scores = verifier.score([VerifierSample(id="a", prompt="q=", completion="4", label="4"),
                                     VerifierSample(id="b", prompt="How many legs?", completion="4", label="4",
                                                    query="Legs: 4")])
    assert reply.status_code == 200 and reply.json()["rewards"] == [1.0, None]
    assert reply.json()["errors"][1].startswith("the query does not start with its prompt nor with any end of it")
    assert scores.rewards == [1.0, None]
    assert scores.metrics["failures"] == 1 and scores.metrics["retries"] == 0 and scores.metrics["requests"] == 1
