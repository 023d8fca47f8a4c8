"""`relay serve` (the Tinker API, docs/tinker.md) as a user runs it, driven by the real `tinker` SDK: a LoRA training
client on the demo model, whose first forward's logprobs are the base model's (the adapters start at zero), whose
supervised loss falls under `forward_backward(cross_entropy)` + `optim_step`; the policy losses (importance_sampling,
ppo, cispo) read the advantages, the sampler's logprobs and the clip thresholds; an unknown loss and malformed datums
get the SDK's error (a failed request, category user) and change nothing; `save_weights_for_sampler` moves the
adapters to a vLLM engine whose samples' logprobs are the learner's, tagged with the weights version; and no API key,
no service; two models train at once without mixing; and a client with the server's other key (another tenant)
reaches none of the first key's models, checkpoints, samplers or requests."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KEY = "tml-relay-test-key"
OTHER_KEY = "tml-relay-other-tenant"  # the server's second key: another tenant


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`relay serve` on the demo model on a free port with an API key; yields its base URL."""
    from bench.tinker_grpo import served as serve

    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    # ray.num_cpus: Ray's logical CPUs, 0.5 each for the module's seven models, their three samplers and the base's.
    with serve(["ray.num_cpus=6", "learner.num_threads=1", "rollout.num_workers=1", f"run_dir={log.parent}"],
               f"{KEY},{OTHER_KEY}", log, timeout=120) as url:
        yield url


@pytest.fixture(scope="module")
def training(served):
    """A LoRA training client on the served demo model, through the SDK."""
    os.environ["TINKER_TELEMETRY"] = "0"
    service = tinker.ServiceClient(base_url=served, api_key=KEY)
    [model] = service.get_server_capabilities().supported_models
    assert model.model_name == "relay-demo"
    return service.create_lora_training_client(base_model="relay-demo", rank=4)


def demo_tokens() -> tuple[list[int], int]:
    """`12+34=77` in the demo tokenizer (an answer the model does not give: its loss is high), and where its answer
    starts."""
    from transformers import AutoTokenizer

    from cluster.demo.cache import ensure_demo_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model(log=lambda _: None)))
    prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    answer = tokenizer("77", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, len(prompt)


def datum(tokens: list[int], answer_at: int, **inputs) -> "tinker.Datum":
    weights = [0.0] * (answer_at - 1) + [1.0] * (len(tokens) - answer_at)
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights, **inputs})


def base_logprobs(tokens: list[int]) -> list[float]:
    """log p(token_t | tokens_<t) of the demo base model, in transformers, float32."""
    from transformers import AutoModelForCausalLM

    from cluster.demo.cache import ensure_demo_model

    model = AutoModelForCausalLM.from_pretrained(str(ensure_demo_model(log=lambda _: None)), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def test_the_loss_falls_and_the_first_logprobs_are_the_base_models(training):
    tokens, answer_at = demo_tokens()
    losses, first = [], None
    for _ in range(6):
        out = training.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
        first = first or out.loss_fn_outputs[0]["logprobs"].tolist()
        losses.append(out.metrics["loss:sum"])
        training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert first == pytest.approx(base_logprobs(tokens), abs=1e-5)  # zero-initialised adapters: the base
    answer = first[answer_at - 1:]
    assert losses[0] == pytest.approx(-sum(answer), abs=1e-4)  # the weighted sum over the answer's tokens
    assert losses[-1] < 0.5 * losses[0], losses


def test_samples_come_from_the_trained_adapters_tagged_with_their_version(training):
    tokens, answer_at = demo_tokens()
    training.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()  # adapters away from zero: not the base
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tinker.ModelInput.from_ints(tokens[:answer_at])
    params = tinker.SamplingParams(max_tokens=3, temperature=1.0, seed=7)
    result = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(result.sequences) == 3
    [version] = {s.sequence_id.split(":v")[1].split(":")[0] for s in result.sequences}
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) == len(seq.logprobs) <= 3 and seq.stop_reason in ("stop", "length")
        row = tokens[:answer_at] + list(seq.tokens)
        forward = training.forward([tinker.Datum(model_input=tinker.ModelInput.from_ints(row[:-1]),
                                                 loss_fn_inputs={"target_tokens": row[1:]})], "cross_entropy").result()
        learner = forward.loss_fn_outputs[0]["logprobs"].tolist()[answer_at - 1:]
        assert list(seq.logprobs) == pytest.approx(learner, abs=1e-4)  # the engine serves the learner's adapters
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    again = training.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result()
    assert again.sequences[0].sequence_id.split(":v")[1].split(":")[0] == str(int(version) + 1)


def test_samples_asked_at_once_are_the_same_as_asked_one_by_one(training):
    # Requests that arrive while the engine samples go to it as one batch (cluster/tinker/sampling.py); the engine is
    # batch-invariant, so each prompt's samples (by its seed) are the bits it gets alone, whatever its batch holds.
    from transformers import AutoTokenizer

    from cluster.demo.cache import ensure_demo_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model(log=lambda _: None)))
    prompts = [tinker.ModelInput.from_ints(tokenizer(p, add_special_tokens=False)["input_ids"])
               for p in ["12+34=", "7+8=", "55+44=", "3+9=", "21+21=", "60+1="]]
    sampler = training.save_weights_and_get_sampling_client().result()

    def params(i: int) -> "tinker.SamplingParams":
        return tinker.SamplingParams(max_tokens=4, temperature=1.0, seed=100 + i)

    alone = [sampler.sample(p, num_samples=4, sampling_params=params(i)).result() for i, p in enumerate(prompts)]
    futures = [sampler.sample(p, num_samples=4, sampling_params=params(i)) for i, p in enumerate(prompts)]
    together = [f.result() for f in futures]
    for one, other in zip(alone, together):
        assert [list(s.tokens) for s in one.sequences] == [list(s.tokens) for s in other.sequences]
        assert [list(s.logprobs) for s in one.sequences] == [list(s.logprobs) for s in other.sequences]
    assert len({tuple(s.tokens) for r in together for s in r.sequences}) > 4  # not one group copied to every prompt


def test_a_base_model_samples_without_a_training_run(served):
    service = tinker.ServiceClient(base_url=served, api_key=KEY)
    sampler = service.create_sampling_client(base_model="relay-demo")
    tokens, answer_at = demo_tokens()
    params = tinker.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    result = sampler.sample(tinker.ModelInput.from_ints(tokens[:answer_at]), num_samples=2,
                            sampling_params=params).result()
    for seq in result.sequences:
        assert seq.sequence_id.startswith("base:v0:")
        row = tokens[:answer_at] + list(seq.tokens)
        assert list(seq.logprobs) == pytest.approx(base_logprobs(row)[answer_at - 1:], abs=1e-4)  # the base's own
    with pytest.raises(tinker.BadRequestError, match="is not served here"):  # refused (400, category user)
        service.create_sampling_client(base_model="Qwen/Qwen3-8B").sample(
            tinker.ModelInput.from_ints(tokens[:answer_at]), num_samples=1, sampling_params=params).result()


def test_sampling_stops_at_a_stop_token_or_string(training):
    from transformers import AutoTokenizer

    from cluster.demo.cache import ensure_demo_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model(log=lambda _: None)))
    prompt = tinker.ModelInput.from_ints(tokenizer("31+44=", add_special_tokens=False)["input_ids"])
    sampler = training.save_weights_and_get_sampling_client().result()

    def sample(stop=None) -> list:
        params = tinker.SamplingParams(max_tokens=5, temperature=1.0, seed=11, stop=stop)
        return sampler.sample(prompt, num_samples=3, sampling_params=params).result().sequences

    free = sample()
    firsts = [s.tokens[0] for s in free]
    text = tokenizer.decode([firsts[0]])
    # The same seed draws the same first tokens: a stop on the first one's token ends its samples there, token kept.
    for stopped, free_seq in zip(sample([firsts[0]]), free):
        if free_seq.tokens[0] == firsts[0]:
            assert list(stopped.tokens) == [firsts[0]] and stopped.stop_reason == "stop"
            assert list(stopped.logprobs) == pytest.approx(list(free_seq.logprobs)[:1], abs=1e-6)
        else:
            assert firsts[0] not in list(stopped.tokens)
    for stopped, free_seq in zip(sample(text), free):  # the same as a string
        if free_seq.tokens[0] == firsts[0]:
            assert list(stopped.tokens) == [firsts[0]] and stopped.stop_reason == "stop"


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_the_policy_losses_take_the_sdks_advantages_logprobs_and_clip_thresholds(training, loss):
    tokens, answer_at = demo_tokens()
    plain = datum(tokens, answer_at)
    rows = training.forward([plain], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    adv = [0.0] * (answer_at - 1) + [1.0] * (len(tokens) - answer_at)
    sampled = [lp - math.log(2.0) for lp in rows]  # the sampler's logprobs: every ratio pi/q is 2
    rl = tinker.Datum(model_input=plain.model_input, loss_fn_inputs={"target_tokens": tokens[1:], "advantages": adv,
                                                                     "logprobs": sampled})
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5} if loss != "importance_sampling" else None
    out = training.forward([rl], loss, config).result()
    ratio = {"importance_sampling": 2.0, "ppo": 1.5, "cispo": 1.5}[loss]
    per_token = [a * (lp if loss == "cispo" else 1.0) for a, lp in zip(adv, rows, strict=True)]
    assert out.metrics["loss:sum"] == pytest.approx(-ratio * sum(per_token), rel=1e-4)
    if loss != "importance_sampling":
        with pytest.raises(tinker.RequestFailedError, match=r"loss_fn_config \['clip_ratio'\] is not read"):
            training.forward([rl], loss, {"clip_ratio": 0.2}).result()


def test_a_saved_state_resumes_exactly_and_bad_paths_are_refused(training):
    tokens, answer_at = demo_tokens()

    def step() -> list[float]:
        training.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
        training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        return training.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0][
            "logprobs"].tolist()

    path = training.save_state("resume-me").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/resume-me")
    after = step()
    training.load_state_with_optimizer(path).result()
    assert step() == after  # bitwise: the adapters and AdamW's moments came back
    for bad, says in ((path.replace("resume-me", "never-saved"), "no checkpoint"), ("/etc/passwd", "not a checkpoint")):
        with pytest.raises(tinker.RequestFailedError, match=says):
            training.load_state(bad).result()
    with pytest.raises(tinker.RequestFailedError, match="is not a plain name"):
        training.save_state("../escape").result()


def test_a_training_client_made_from_a_saved_state_continues_it(served, training):
    tokens, answer_at = demo_tokens()

    def logprobs(client) -> list[float]:
        return client.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0][
            "logprobs"].tolist()

    def step(client) -> list[float]:
        client.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
        client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        return logprobs(client)

    training.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()  # AdamW has moments to carry over
    path = training.save_state("from-state").result().path
    service = tinker.ServiceClient(base_url=served, api_key=KEY)
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert restored.model_id != training.model_id and restored.get_info().lora_rank == 4
    assert logprobs(restored) == logprobs(training)  # the same adapters, bit for bit
    assert step(restored) == step(training)  # and the same AdamW state: the next step is the same too
    again = restored.save_state("again").result().path  # a model made from a state saves and loads as any
    restored.load_state(again).result()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        service.create_training_client_from_state(path.replace("from-state", "never-saved")).result()


def test_two_models_train_at_once_without_mixing(served, training):
    tokens, answer_at = demo_tokens()
    other = tinker.ServiceClient(base_url=served, api_key=KEY).create_lora_training_client(
        base_model="relay-demo", rank=2)
    assert other.model_id != training.model_id

    def logprobs(client) -> list[float]:
        return client.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0][
            "logprobs"].tolist()

    before, other_before = logprobs(training), logprobs(other)
    for _ in range(2):  # the other model trains; gradients sent to this one meanwhile wait for its own step
        training.forward_backward([datum(tokens, answer_at)], "cross_entropy")
        other.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
        other.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert logprobs(training) == before  # untouched by the other's steps
    assert logprobs(other) != other_before
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert logprobs(training) != before
    # Both models' adapters on the same engine (their ranks 4 and 2 share a pool: vLLM's multi-LoRA): each samples
    # with its own, the engine's logprobs of its samples are its learner's.
    for client in (training, other):
        sampler = client.save_weights_and_get_sampling_client().result()
        prompt = tinker.ModelInput.from_ints(tokens[:answer_at])
        for seq in sampler.sample(prompt, 3, tinker.SamplingParams(max_tokens=3, seed=5)).result().sequences:
            row = tokens[:answer_at] + list(seq.tokens)
            forward = client.forward([tinker.Datum(model_input=tinker.ModelInput.from_ints(row[:-1]),
                                                   loss_fn_inputs={"target_tokens": row[1:]})], "cross_entropy")
            learner = forward.result().loss_fn_outputs[0]["logprobs"].tolist()[answer_at - 1:]
            assert list(seq.logprobs) == pytest.approx(learner, abs=1e-4)


@pytest.mark.parametrize("loss", ["dro", "gspo"])
def test_an_unknown_loss_is_refused_by_name(training, loss):
    tokens, answer_at = demo_tokens()
    with pytest.raises(tinker.RequestFailedError, match=f"loss_fn '{loss}' is not supported") as failed:
        training.forward_backward([datum(tokens, answer_at)], loss).result()
    assert failed.value.category == tinker.types.RequestErrorCategory.User


def test_malformed_datums_are_refused_with_a_user_error(training):
    tokens, answer_at = demo_tokens()
    short = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:-1]})
    outside = tinker.Datum(model_input=tinker.ModelInput.from_ints([10**6, *tokens[1:-1]]),
                           loss_fn_inputs={"target_tokens": tokens[1:]})
    for bad, says in ((short, "target_tokens has"), (outside, "outside the model's vocabulary")):
        with pytest.raises(tinker.RequestFailedError, match=says):
            training.forward_backward([bad], "cross_entropy").result()


@pytest.mark.parametrize("base, rank, says", [("Qwen/Qwen3-8B", 4, "is not served here; use 'relay-demo'"),
                                              ("relay-demo", 1024, "LoRA rank 1024 is out of bounds")])
def test_a_model_that_cannot_be_made_is_refused(served, base, rank, says):
    service = tinker.ServiceClient(base_url=served, api_key=KEY)
    with pytest.raises(tinker.RequestFailedError, match=says) as failed:
        service.create_lora_training_client(base_model=base, rank=rank).result()
    assert failed.value.category == tinker.types.RequestErrorCategory.User


def test_without_the_key_nothing_is_served(served):
    assert httpx.get(f"{served}/api/v1/healthz").status_code == 401
    assert httpx.get(f"{served}/api/v1/healthz", headers={"X-API-Key": "tml-wrong"}).status_code == 401


def test_a_model_without_lora_config_is_fully_fine_tuned(served):
    # The served config trains no LoRA (learner.lora.rank 0), so a create_model without lora_config (the REST API's;
    # the SDK's training clients are LoRA) fine-tunes every weight: its steps, its sampler (the whole weights synced)
    # and its checkpoints work as a LoRA model's do.
    from tinker.lib.public_interfaces.training_client import TrainingClient

    headers = {"X-API-Key": KEY}
    request = httpx.post(f"{served}/api/v1/create_model", headers=headers, json={"base_model": "relay-demo"}).json()
    answer = httpx.post(f"{served}/api/v1/retrieve_future", headers=headers, json=request, timeout=60).json()
    info = httpx.post(f"{served}/api/v1/get_info", headers=headers, json={"model_id": answer["model_id"]}).json()
    assert info["is_lora"] is False and info["lora_rank"] is None
    service = tinker.ServiceClient(base_url=served, api_key=KEY)
    full = TrainingClient(service.holder, service.holder.get_training_client_id(), answer["model_id"],
                          info=tinker.types.GetInfoResponse.model_validate(info))
    tokens, answer_at = demo_tokens()
    first = full.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert first == pytest.approx(base_logprobs(tokens), abs=1e-4)  # the base model's, before any step
    for _ in range(3):
        full.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
        full.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
    after = full.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert sum(after[answer_at - 1:]) > sum(first[answer_at - 1:]) + 0.5
    sampler = full.save_weights_and_get_sampling_client().result()
    seq = sampler.sample(tinker.ModelInput.from_ints(tokens[:answer_at]), 1,
                         tinker.SamplingParams(max_tokens=3, temperature=1.0, seed=3)).result().sequences[0]
    row = tokens[:answer_at] + list(seq.tokens)
    learner = full.forward([tinker.Datum(model_input=tinker.ModelInput.from_ints(row[:-1]),
                                         loss_fn_inputs={"target_tokens": row[1:]})], "cross_entropy").result()
    assert list(seq.logprobs) == pytest.approx(learner.loss_fn_outputs[0]["logprobs"].tolist()[answer_at - 1:],
                                               abs=1e-4)  # the engine holds the trained weights
    path = full.save_state("full").result().path
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert restored.get_info().is_lora is False
    assert restored.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0][
        "logprobs"].tolist() == after


def test_another_keys_tenant_reaches_none_of_this_keys_models(served, training):
    tokens, answer_at = demo_tokens()
    path = training.save_state("mine").result().path
    sampler_path = training.save_weights_for_sampler("mine").result().path
    model = training.model_id

    def post(route: str, key: str = OTHER_KEY, **body) -> httpx.Response:
        return httpx.post(f"{served}/api/v1/{route}", headers={"X-API-Key": key}, json=body, timeout=30)

    def failure(answer: httpx.Response) -> str:  # the error of a refusal, or of the future it answered with
        if "request_id" not in answer.json():
            return answer.json().get("detail") or answer.json()["error"]
        return post("retrieve_future", request_id=answer.json()["request_id"]).json()["error"]

    pending = post("save_weights", KEY, model_id=model, path="mine-too").json()["request_id"]  # this tenant's
    assert "is unknown to this server" in failure(post("get_info", model_id=model))
    assert "is unknown to this server" in failure(post("optim_step", model_id=model,
                                                       adam_params={"learning_rate": 1e-2}))
    assert "is unknown to this server" in failure(post("save_weights_for_sampler", model_id=model))
    assert "no checkpoint" in failure(post("load_weights", path=path, session_id="s", model_seq_id=0))
    assert "is not a sampler's weights" in failure(post("create_sampling_session", model_path=sampler_path))
    assert "is unknown to this server" in post("retrieve_future", request_id=pending).json()["error"]
    assert post("retrieve_future", KEY, request_id=pending).json()["path"].endswith("/weights/mine-too")
    # The other tenant's own model works, and the first key cannot reach it either.
    mine = tinker.ServiceClient(base_url=served, api_key=OTHER_KEY).create_lora_training_client(
        base_model="relay-demo", rank=2)
    assert mine.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs
    assert post("get_info", OTHER_KEY, model_id=mine.model_id).json()["model_id"] == mine.model_id
    assert "is unknown to this server" in failure(post("get_info", KEY, model_id=mine.model_id))


def test_web_pages_are_refused(served):
    page = {"X-API-Key": KEY, "Origin": "https://evil.example"}
    refused = httpx.post(f"{served}/api/v1/create_session", headers=page, json={"tags": [], "sdk_version": "x"})
    assert refused.status_code == 403 and "relay serve --allow-origin" in refused.json()["detail"]


def test_beyond_loopback_an_api_key_is_required():
    script = Path(sys.executable).parent / "relay"
    result = subprocess.run([str(script), "serve", "--host", "0.0.0.0", "--port", "0"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "--host 0.0.0.0 is beyond loopback: set an API key" in line


def test_after_a_restart_checkpoints_load_and_pending_futures_fail_clearly(tmp_path):
    from bench.tinker_grpo import served as serve

    args = ["ray.num_cpus=2", "learner.num_threads=1", f"run_dir={tmp_path}"]
    tokens, answer_at = demo_tokens()
    with serve(args, KEY, tmp_path / "first.txt", timeout=120) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY).create_lora_training_client(
            base_model="relay-demo", rank=2)
        client.forward_backward([datum(tokens, answer_at)], "cross_entropy").result()
        client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        path = client.save_state("before-restart").result().path
        before = client.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        pending = httpx.post(f"{url}/api/v1/save_weights", headers={"X-API-Key": KEY}, timeout=30,
                             json={"model_id": client.model_id, "path": "never-polled"}).json()["request_id"]
    with serve(args, KEY, tmp_path / "second.txt", timeout=120) as url:  # the same run_dir: the same checkpoints
        lost = httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": KEY}, timeout=30,
                          json={"request_id": pending}).json()
        assert lost["category"] == "user" and "is unknown to this server (restarted since?)" in lost["error"]
        restored = tinker.ServiceClient(base_url=url, api_key=KEY).create_training_client_from_state(path).result()
        after = restored.forward([datum(tokens, answer_at)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        assert after.tolist() == before.tolist()  # the saved adapters, bit for bit
