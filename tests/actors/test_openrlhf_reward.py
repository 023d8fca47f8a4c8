"""OpenRLHF's remote reward protocol, both directions (rewards/openrlhf.py, docs/verifiers.md).

Serving: OpenRLHF's real client, `SingleTurnAgentExecutor._fetch_rewards_via_http` (read in
openrlhf/utils/agent.py of OpenRLHF 0.11.2: it POSTs `{"query", "prompts", "labels"}` to each `remote_rm_url` and
returns the reply bodies; `execute` builds each query with `hf_tokenizer.decode(prompt + response token ids,
skip_special_tokens=False)` and reads `rewards`, `scores` and `extra_logs`), against relay's `/get_reward`,
in-process and as `relay verifier serve`.
Consuming: relay's client (`RemoteVerifier`, `protocol: openrlhf`) against a server answering as OpenRLHF's reference
server does (openrlhf/cli/serve_rm.py: `POST /get_reward` reads `data["query"]`, answers
`{"rewards", "scores", "extra_logs": {"dummy_scores": ...}}`), and against relay's own `/get_reward`; faults under
every failure policy; the run's Scorer decoding each query with the policy's tokenizer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openrlhf.utils.agent import SingleTurnAgentExecutor
from pydantic import ValidationError

from actors.rollout_types import Rollout
from cluster.demo.task import Problem
from rewards.config import RemoteSource, RewardConfig
from rewards.openrlhf import DEFAULT_SPECIAL_TOKENS, completion_of, longest_first, special_tokens_from
from rewards.remote import RemoteVerifier, RemoteVerifierError, VerifierSample
from rewards.service import app_from_spec, create_app, run_in_thread
from rewards.verifiers import exact_match, numeric_match

ROOT = Path(__file__).resolve().parents[2]
DEMO_TOKENIZER = ROOT / "cluster" / "demo" / "models" / "demo-model-v1"  # special tokens: <eos>, <pad>
CHAT = "<|im_start|>system\nYou add.<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"


def openrlhf_rewards(url: str, queries: list[str], prompts: list[str], labels: list) -> list[dict]:
    """What OpenRLHF's own client reads back from `url` (one reply body per server: here one)."""
    client = SingleTurnAgentExecutor(remote_rm_url=url)
    return asyncio.run(client._fetch_rewards_via_http(queries, prompts, labels))


def source(urls: list[str], **overrides) -> RemoteSource:
    """An OpenRLHF-protocol client config with quick timeouts: 3 retries within ~0.1 s of backoff."""
    fields = dict(type="remote", protocol="openrlhf", urls=urls, batch_size=2, max_concurrency=2, timeout=2.0,
                  max_retries=3, backoff=0.01, backoff_max=0.04)
    return RemoteSource(**{**fields, **overrides})


def reference_server(rewards_of=lambda queries: [float(q.endswith("4")) for q in queries]) -> FastAPI:
    """A server answering as OpenRLHF's openrlhf/cli/serve_rm.py route does (its reward model replaced by
    `rewards_of(queries)`); each request body is kept in `app.state.bodies`."""
    app = FastAPI()
    app.state.bodies = []

    @app.post("/get_reward")
    async def get_reward(request: Request):
        data = await request.json()
        app.state.bodies.append(data)
        queries = data.get("query")
        rewards = rewards_of(queries)
        return JSONResponse({"rewards": rewards, "scores": rewards, "extra_logs": {"dummy_scores": rewards}})

    return app


class Recorder:
    """`verifier` (exact_match) that records each completion it is given."""

    def __init__(self, verifier=exact_match):
        self.completions: list[str] = []
        self.verifier = verifier

    def __call__(self, completion: str, label) -> float:
        self.completions.append(completion)
        return self.verifier(completion, label)


# Serving: OpenRLHF's client against relay.

def test_openrlhf_client_reads_relays_rewards_for_queries_with_special_tokens():
    recorder = Recorder()
    queries = [CHAT + "4<|im_end|><|endoftext|>",  # right: the completion is "4" once the special tokens are gone
               CHAT + "5<|im_end|>",  # wrong
               CHAT[20:] + "4<|im_end|>"]  # OpenRLHF cut the prompt on the left: found by its tail, flagged
    with run_in_thread(create_app(recorder, workers=2)) as url:
        replies = openrlhf_rewards(f"{url}/get_reward", queries, [CHAT] * 3, ["4"] * 3)
    assert replies == [{"rewards": [1.0, 0.0, 1.0], "scores": [1.0, 0.0, 1.0],
                        "extra_logs": {"prompt_mismatch": [0.0, 0.0, 1.0]}}]
    assert sorted(recorder.completions) == ["4", "4", "5"]


# A question whose own numbers end with the label: scored whole, a non-answer would read 8 and score 1.0.
SPIDER = "How many legs does 1 spider have ? Count them , not the 8 eyes . Answer :"


def test_a_query_whose_prompt_changed_is_scored_on_its_response_alone():
    from transformers import AutoTokenizer

    cleaned = AutoTokenizer.from_pretrained(DEMO_TOKENIZER).clean_up_tokenization(SPIDER)  # what decode may give
    assert cleaned != SPIDER
    recorder = Recorder(numeric_match)
    queries = ["<s>" + SPIDER + " I am not sure.</s>",  # a BOS before the prompt
               cleaned + " I am not sure.</s>",  # the tokenizer cleaned up the prompt's spaces
               SPIDER[30:] + " I am not sure.</s>",  # OpenRLHF cut the prompt on the left
               "<s>" + SPIDER + " 8</s>"]  # right
    with run_in_thread(create_app(recorder, workers=1)) as url:
        replies = openrlhf_rewards(f"{url}/get_reward", queries, [SPIDER] * 4, ["8"] * 4)
    assert recorder.completions == [" I am not sure."] * 3 + [" 8"]
    assert replies == [{"rewards": [0.0, 0.0, 0.0, 1.0], "scores": [0.0, 0.0, 0.0, 1.0],
                        "extra_logs": {"prompt_mismatch": [0.0, 1.0, 1.0, 0.0]}}]


def test_a_query_that_does_not_hold_its_prompt_is_not_scored():
    # Neither the prompt nor any tail of it starts the query: its text is not scored as an answer.
    strip = longest_first(DEFAULT_SPECIAL_TOKENS)
    with pytest.raises(ValueError, match=r"^the query does not start with its prompt nor with any end of it"):
        completion_of("<s>Legs: 8</s>", SPIDER, strip)
    assert completion_of("<s>Legs: 8</s>", None, strip) == ("Legs: 8", False)  # no prompt sent: scored whole
    assert completion_of("<s>Legs: 8</s>", "<s>", strip) == ("Legs: 8", True)  # a prompt of special tokens only
    recorder = Recorder(numeric_match)
    with run_in_thread(create_app(recorder)) as url:
        reply = httpx.post(f"{url}/get_reward", json={"query": ["<s>Legs: 8</s>"], "prompts": [SPIDER],
                                                      "labels": ["8"]})
    assert recorder.completions == []
    assert reply.status_code != 200 or reply.json()["rewards"] != [1.0]


def test_relay_verifier_serve_answers_openrlhfs_client(serve_verifier):
    _, url = serve_verifier(["--verifier", "exact_match"])
    replies = openrlhf_rewards(f"{url}/get_reward", [CHAT + "4<|im_end|>", CHAT + "4 <|im_end|>"], [CHAT] * 2,
                               ["4"] * 2)
    assert replies == [{"rewards": [1.0, 0.0], "scores": [1.0, 0.0], "extra_logs": {"prompt_mismatch": [0.0, 0.0]}}]


def test_a_tokenizers_special_tokens_replace_the_default_list():
    app = app_from_spec("exact_match", tokenizer=str(DEMO_TOKENIZER))  # what --tokenizer loads
    with run_in_thread(app) as url:
        replies = openrlhf_rewards(f"{url}/get_reward", ["1+2=3<eos><pad>", "1+2=3<|im_end|>"], ["1+2="] * 2,
                                   ["3"] * 2)
    # The demo tokenizer's special tokens are `<eos>` and `<pad>`: `<|im_end|>` is text to it, and stays.
    assert replies[0]["rewards"] == [1.0, 0.0] and "<|im_end|>" in DEFAULT_SPECIAL_TOKENS
    with pytest.raises(ValueError, match="--tokenizer '/no/such/dir': cannot load a tokenizer from it"):
        app_from_spec("exact_match", tokenizer="/no/such/dir")


def test_a_tokenizers_added_special_tokens_are_stripped_too(tmp_path):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    # Llama-3's <|python_tag|> is an added token with special=True, outside `all_special_tokens`.
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.add_tokens([AddedToken("<|python_tag|>", special=True), AddedToken("<|text|>", special=False)])
    tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert "<|python_tag|>" not in tokenizer.all_special_tokens
    response = tokenizer("3<|python_tag|><|text|><eos>", add_special_tokens=False)["input_ids"]
    seen = tokenizer.decode(response, skip_special_tokens=True)  # what relay's rollouts give a verifier
    assert seen == "3<|text|>"
    recorder = Recorder()
    app = create_app(recorder, special_tokens=special_tokens_from(str(tmp_path)))
    with run_in_thread(app) as url:
        replies = openrlhf_rewards(f"{url}/get_reward", ["1+2=3<|python_tag|><|text|><eos>"], ["1+2="], [seen])
    assert recorder.completions == [seen] and replies[0]["rewards"] == [1.0]


def test_service_refuses_bad_openrlhf_requests_clearly():
    def boom(completion, label):
        if completion == "raise":
            raise RuntimeError("secret detail")
        return 1.0

    app = create_app(boom, max_batch=2, max_body_bytes=2000, token="tok-123")
    steps_only = create_app(step_verifier=lambda steps, label: [1.0] * len(steps))
    auth = {"Authorization": "Bearer tok-123"}
    with run_in_thread(app) as url, run_in_thread(steps_only) as steps_url, httpx.Client(base_url=url) as client:
        ok = client.post("/get_reward", json={"query": ["a"]}, headers=auth)  # prompts, labels optional
        no_token = client.post("/get_reward", json={"query": ["a"]})
        not_a_list = client.post("/get_reward", json={"query": "a", "prompts": ["a"]}, headers=auth)
        lopsided = client.post("/get_reward", json={"query": ["a", "b"], "prompts": ["a"]}, headers=auth)
        too_many = client.post("/get_reward", json={"query": ["a"] * 3}, headers=auth)
        too_big = client.post("/get_reward", json={"query": ["x" * 3000]}, headers=auth)
        raised = client.post("/get_reward", json={"query": ["p1", "praise"], "prompts": ["p"] * 2}, headers=auth)
        steps = httpx.post(f"{steps_url}/get_reward", json={"query": ["a"]})
    assert ok.status_code == 200 and ok.json()["rewards"] == [1.0]
    assert no_token.status_code == 401
    assert not_a_list.status_code == 422 and [e["loc"] for e in not_a_list.json()["detail"]] == [["query"]]
    assert lopsided.status_code == 422 and lopsided.json()["detail"] == ("prompts has 1 entries for 2 queries; send "
                                                                          "one per query")
    assert too_many.status_code == 413 and "3 queries exceed max_batch=2" in too_many.json()["detail"]
    assert too_big.status_code == 413 and "max_body_bytes=2000" in too_big.json()["detail"]
    assert raised.status_code == 200 and raised.json()["rewards"] == [1.0, None]  # test_get_reward_failures.py
    assert "secret detail" not in raised.text
    assert steps.status_code == 501 and "serve it with --verifier" in steps.json()["detail"]


# Consuming: relay's client with `protocol: openrlhf`.

def samples() -> list[VerifierSample]:
    return [VerifierSample(id="a", prompt=CHAT, completion="4", label="4", query=CHAT + "4<|im_end|>"),
            VerifierSample(id="b", prompt=CHAT, completion="5", label="4", query=CHAT + "5<|im_end|>"),
            VerifierSample(id="c", prompt="1+3=", completion="4", label={"n": 4})]  # no query: prompt + completion


def test_relay_sends_openrlhfs_request_shape_and_reads_rewards():
    app = reference_server()
    with run_in_thread(app) as url, RemoteVerifier("judge", source([f"{url}/get_reward"])) as verifier:
        scores = verifier.score(samples())
    bodies = sorted(app.state.bodies, key=lambda body: -len(body["query"]))  # the two requests run concurrently
    assert bodies == [  # batch_size 2: two requests, exactly OpenRLHF's keys and nothing else
        {"query": [CHAT + "4<|im_end|>", CHAT + "5<|im_end|>"], "prompts": [CHAT, CHAT], "labels": ["4", "4"]},
        {"query": ["1+3=4"], "prompts": ["1+3="], "labels": [{"n": 4}]}]
    assert scores.rewards == [0.0, 0.0, 1.0]  # the reference "model" rewards queries ending in 4
    assert scores.metrics["requests"] == 2 and scores.metrics["failures"] == 0


def test_relay_consumes_relays_own_get_reward():
    with run_in_thread(app_from_spec("exact_match")) as url:
        with RemoteVerifier("judge", source([f"{url}/get_reward"], batch_size=8)) as verifier:
            scores = verifier.score(samples())
    assert scores.rewards == [1.0, 0.0, 0.0]  # c: label {"n": 4} is not "4"


WRONG = [
    ("one reward short", lambda queries: [1.0] * (len(queries) - 1), "malformed reply: 1 rewards for 2 queries"),
    ("not a number", lambda queries: ["1.0"] * len(queries), 'malformed reply: reward 0 is "1.0", not a finite number'),
    ("no rewards", lambda queries: None, 'malformed reply: expected {"rewards": [one number per query, ...]}'),
]


@pytest.mark.parametrize("policy", ["fail", "drop", "default"])
@pytest.mark.parametrize("case, rewards_of, message", WRONG, ids=[c[0] for c in WRONG])
def test_a_malformed_reply_is_retried_then_follows_the_policy(policy, case, rewards_of, message):
    app = reference_server(rewards_of)
    extra = {"default_reward": -1.0} if policy == "default" else {}
    with run_in_thread(app) as url:
        endpoint = f"{url}/get_reward"
        with RemoteVerifier("judge", source([endpoint], on_failure=policy, **extra)) as verifier:
            try:
                outcome = verifier.score(samples()[:2])
            except RemoteVerifierError as err:
                outcome = err
    assert len(app.state.bodies) == 4  # the first try and 3 retries
    if policy == "fail":
        assert isinstance(outcome, RemoteVerifierError)
        assert str(outcome) == f"verifier 'judge' at {endpoint} failed: 3 retries exhausted: {message} (2 samples " \
                               "unscored)"
        metrics = outcome.metrics
    else:
        assert outcome.rewards == ([None, None] if policy == "drop" else [-1.0, -1.0])
        metrics = outcome.metrics
    assert metrics["failures"] == 2 and metrics["retries"] == 3


def test_a_query_the_service_cannot_score_is_not_retried():
    def boom(completion, label):
        raise RuntimeError("no")

    with run_in_thread(create_app(boom)) as url:
        with RemoteVerifier("judge", source([f"{url}/get_reward"], on_failure="drop")) as verifier:
            scores = verifier.score(samples()[:1])
    assert scores.rewards == [None] and scores.metrics["requests"] == 1 and scores.metrics["retries"] == 0


def test_config_takes_endpoint_urls_and_refuses_steps():
    assert source(["http://127.0.0.1:5000/get_reward"]).urls == ["http://127.0.0.1:5000/get_reward"]
    assert RemoteSource(type="remote", urls=["http://127.0.0.1:8000"]).protocol == "relay"
    with pytest.raises(ValidationError, match="not an endpoint URL: with protocol openrlhf give the whole URL"):
        source(["http://127.0.0.1:5000"])
    with pytest.raises(ValidationError, match=r"an endpoint URL like .../get_reward needs protocol=openrlhf"):
        RemoteSource(type="remote", urls=["http://127.0.0.1:5000/get_reward"])
    with pytest.raises(ValidationError, match="protocol openrlhf scores whole completions .* level steps needs "
                                              "protocol relay"):
        source(["http://127.0.0.1:5000/get_reward"], level="steps")


def test_the_scorer_sends_queries_decoded_with_special_tokens_as_openrlhf_does():
    from cluster.run.scoring import Scorer

    app = reference_server(lambda queries: [float(q.endswith("3<eos>")) for q in queries])
    with run_in_thread(app) as url:
        config = RewardConfig(sources={"judge": source([f"{url}/get_reward"]).model_dump()})
        scorer = Scorer(config, reward_timeout=10)
        try:
            scorer.attach({}, str(DEMO_TOKENIZER))  # the policy's tokenizer: `<eos>` is id 1
            ids = scorer.query_tokenizer("1+2=3", add_special_tokens=False)["input_ids"]
            done = Rollout(ids[:4], np.asarray([*ids[4:], 1], np.int32), np.zeros(2, np.float32), "3", "stop", 0)
            cut = Rollout(ids[:4], np.asarray(ids[4:], np.int32), np.zeros(1, np.float32), "3", "length", 0)
            result = scorer.score([Problem("1+2=", "3")], [[done, cut]])
        finally:
            scorer.close()
    assert app.state.bodies == [{"query": ["1+2=3<eos>", "1+2=3"], "prompts": ["1+2="] * 2, "labels": ["3", "3"]}]
    assert result.rewards == [[1.0, 0.0]] and result.per_source["judge"] == [1.0, 0.0]
