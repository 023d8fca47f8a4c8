"""RolloutWorker with the real vLLM engine, in-process: sampling, logprobs, in-place weight loads, tied heads and
the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engine import EngineSettings, Request
from actors.rollout import RolloutWorker, SampleProbe, SamplingSettings
from actors.vllm_extension import torch_linear
from bench.batch_invariance import sample_splits
from sync.fingerprint import fingerprint

pytestmark = pytest.mark.slow

PROBE = "1+1=2 2+2=4 3+3=6 4+4=8 5+5=10 6+6=12 7+7=14 "  # 44 tokens: fills one 32-token KV block


def hf_logprobs(model, prompt_ids, response_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logprobs[len(prompt_ids) - 1:]


def perturbed_state(model_dir, seed: int, scale: float = 0.05):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def buckets_of(model):
    return [[(name, t.detach().numpy()) for name, t in model.state_dict().items()]]


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    w = RolloutWorker(EngineSettings(model_path=str(tiny_model_dir)))
    yield w
    w.shutdown()


def test_generate_returns_g_completions_with_engine_logprobs(worker, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    sampling = SamplingSettings(group_size=4, max_new_tokens=6)
    groups = worker.generate(["37+45=", "1+2="], seeds=[1, 2], sampling=sampling)
    assert [len(g) for g in groups] == [4, 4]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for group, prompt in zip(groups, ["37+45=", "1+2="]):
        for r in group:
            assert r.prompt_ids == worker.tokenizer.encode(prompt, add_special_tokens=False)
            assert 1 <= len(r.response_ids) <= 6 and len(r.behavior_logprobs) == len(r.response_ids)
            assert r.finish_reason in ("stop", "length") and r.weights_version == 0
            assert (r.finish_reason == "stop") == (r.response_ids[-1] == 1)  # <eos> is id 1
            expected = hf_logprobs(model, r.prompt_ids, r.response_ids)
            torch.testing.assert_close(torch.tensor(r.behavior_logprobs), expected, atol=1e-4, rtol=0)


def test_texts_and_logprobs_are_what_vllm_itself_detokenizes_and_reports(worker):
    """The adapter skips vLLM's per-token detokenizer and Logprob objects (detokenize=False, flat logprobs) and decodes
    the texts in one batch: the same texts, tokens and logprobs as vLLM's own path with the same seeds."""
    from vllm import SamplingParams, TokensPrompt

    prompts, seeds = ["37+45=", "1+2=", "99+99="], [3, 4, 5]
    ours = worker.generate(prompts, seeds, SamplingSettings(group_size=4, max_new_tokens=8))
    ids = [worker.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = [SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=8, logprobs=0, seed=s,
                             skip_special_tokens=True) for s in seeds]
    theirs = worker.engine.llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], params, use_tqdm=False)
    got = [[(r.response_ids, r.behavior_logprobs, r.text) for r in g] for g in ours]
    want = [[(list(c.token_ids), [p[t].logprob for t, p in zip(c.token_ids, c.logprobs)], c.text) for c in o.outputs]
            for o in theirs]
    assert got == want
    assert any(r.text for g in ours for r in g) and any(r.finish_reason == "stop" for g in ours for r in g)


def assert_split_invariant(worker: RolloutWorker) -> None:
    """A prompt's completions, tokens and logprobs, are the same bits whichever of the step's prompts shared its
    requests: the step whole, or split into requests of 1 to 9 prompts in another order."""
    assert worker.engine.batch_invariant
    prompts = [f"{a}+{b}=" for a, b in zip(range(3, 90, 7), range(80, 1, -6))]  # 13 prompts
    seeds = list(range(100, 100 + len(prompts)))
    sampling = SamplingSettings(group_size=3, max_new_tokens=8)  # 3 per prompt: batches of every size

    whole = sample_splits(worker, prompts, seeds, sampling, [list(range(len(prompts)))])
    order = [int(i) for i in np.random.default_rng(0).permutation(len(prompts))]
    for sizes in ((1, 2, 3, 7), (5, 1, 1, 6), (4, 9)):
        splits = [order[sum(sizes[:k]):sum(sizes[:k + 1])] for k in range(len(sizes))]
        assert sample_splits(worker, prompts, seeds, sampling, splits) == whole, sizes


def test_a_prompts_completions_are_the_same_bits_however_the_step_is_split_between_requests(worker):
    """The driver splits a step's prompts between the workers by their measured speed (`rollout.balance`), so which
    prompts share an engine batch, and how many sequences each of its forward passes holds, depend on timing; a
    prompt's completions must not, or a run would not repeat bit for bit (resume). Torch's float32 linear (this
    engine's kernel: the tiny model's, `cpu_linear` auto) computes some rows of a batch with another micro-kernel,
    which rows depending on the CPU; `torch_linear` runs every matmul on a fixed number of rows, and the engine
    checks every kernel at its start. The other kernels and bfloat16:
    `test_the_probe_rides_in_its_request_with_the_bits_of_a_probe_alone`."""
    assert_split_invariant(worker)


def test_prompts_given_as_token_ids_sample_exactly_like_their_text(worker):
    """A dataset's prompts are tokenised once, by the driver (cluster/run/data.py), and reach the engine as ids."""
    sampling = SamplingSettings(group_size=3, max_new_tokens=6)
    ids = [np.asarray(worker.tokenizer.encode(p, add_special_tokens=False), dtype=np.int32) for p in ["37+45=", "1+2="]]
    by_text = worker.generate(["37+45=", "1+2="], [4, 5], sampling)
    by_ids = worker.generate(ids, [4, 5], sampling)
    assert [[(r.prompt_ids, list(r.response_ids), list(r.behavior_logprobs)) for r in g] for g in by_text] == \
        [[(r.prompt_ids, list(r.response_ids), list(r.behavior_logprobs)) for r in g] for g in by_ids]


def test_load_weights_updates_the_running_engine(worker, tiny_model_dir):
    assert worker.engine.direct_loads  # `rollout.cpu_linear` auto: torch's linear for a model under 1M parameters
    new = perturbed_state(tiny_model_dir, seed=3)
    loaded = worker.load_weights(5, *buckets_of(new))
    # the fingerprints of exactly what the engine was handed
    assert loaded.version == 5 and loaded.fingerprints == (fingerprint(new.state_dict().items()),)
    base = perturbed_state(tiny_model_dir, seed=0, scale=0.0)
    assert loaded.fingerprints != (fingerprint(base.state_dict().items()),)
    [[r]] = worker.generate(["37+45="], [11], SamplingSettings(group_size=1, max_new_tokens=6))
    assert r.weights_version == 5
    expected = hf_logprobs(new, r.prompt_ids, r.response_ids)
    torch.testing.assert_close(torch.tensor(r.behavior_logprobs), expected, atol=1e-4, rtol=0)
    # and it is not the old model any more
    old = perturbed_state(tiny_model_dir, seed=0, scale=0.0)
    assert (hf_logprobs(old, r.prompt_ids, r.response_ids) - expected).abs().max() > 1e-2


def test_generate_given_weights_loads_them_first(worker, tiny_model_dir):
    """The deferred sync (`sync.probe=false`): the load rides on the next request, prefix cache reset included."""
    first, second = perturbed_state(tiny_model_dir, seed=6), perturbed_state(tiny_model_dir, seed=7)
    sampling = SamplingSettings(group_size=2, max_new_tokens=6)
    for version, model in ((10, first), (11, second)):  # the second call's prompt is cached from the first
        groups = worker.generate([PROBE], [3], sampling, version, *buckets_of(model))
        assert worker.weights_version == version and groups.loaded.version == version
        assert groups.loaded.fingerprints == (fingerprint(model.state_dict().items()),)
        [group] = groups
        for r in group:
            assert r.weights_version == version
            torch.testing.assert_close(torch.tensor(r.behavior_logprobs),
                                       hf_logprobs(model, r.prompt_ids, r.response_ids), atol=1e-4, rtol=0)


def test_load_from_the_learners_shared_buffer_copies_it_into_the_engine(worker, tiny_model_dir):
    """`sync.shared_memory`: the engine reads the learner's buffer, keeps its own copy, and refuses a stale handle."""
    from sync.shared_memory import SharedWeights

    first, second = perturbed_state(tiny_model_dir, seed=8), perturbed_state(tiny_model_dir, seed=9)
    shared = SharedWeights(first.state_dict())
    sampling = SamplingSettings(group_size=1, max_new_tokens=6)
    try:
        handle = shared.write(first.state_dict(), version=12)
        assert worker.load_weights(12, handle) == (12, (fingerprint(first.state_dict().items()),))
        shared.write(second.state_dict(), version=13)  # the buffer changes; the engine must not see it
        [[r]] = worker.generate(["37+45="], [11], sampling)
        assert r.weights_version == 12
        expected = hf_logprobs(first, r.prompt_ids, r.response_ids)
        torch.testing.assert_close(torch.tensor(r.behavior_logprobs), expected, atol=1e-4, rtol=0)
        assert (hf_logprobs(second, r.prompt_ids, r.response_ids) - expected).abs().max() > 1e-2
        with pytest.raises(RuntimeError, match="holds version 13, not version 12"):
            worker.load_weights(12, handle)
    finally:
        shared.close()


def test_prefix_cache_is_reset_on_load(worker, tiny_model_dir, monkeypatch):
    """The probe prompt is cached after one call; a load that skipped the reset would score with stale KV, and the
    first probe after it says so by the prompt tokens it took from the cache (what the sync check looks at)."""
    first = perturbed_state(tiny_model_dir, seed=4)
    second = perturbed_state(tiny_model_dir, seed=5)
    worker.load_weights(6, *buckets_of(first))
    assert worker.probe(PROBE, 4, 1.0, seed=1).cached_prompt_tokens == 0  # caches the prompt's first block
    assert worker.probe(PROBE, 4, 1.0, seed=1).cached_prompt_tokens == 32  # ... and reads it
    worker.load_weights(7, *buckets_of(second))
    sample = worker.probe(PROBE, 4, 1.0, seed=1)
    assert sample.weights_version == 7 and sample.cached_prompt_tokens == 0
    torch.testing.assert_close(torch.tensor(sample.logprobs),
                               hf_logprobs(second, sample.prompt_ids, sample.response_ids), atol=1e-4, rtol=0)

    # The same sequence of events with the reset skipped gives stale logprobs: the reset is what we rely on.
    worker.load_weights(8, *buckets_of(first))
    worker.probe(PROBE, 4, 1.0, seed=1)
    monkeypatch.setattr(worker.engine, "reset_prefix_cache", lambda running=False: None)
    worker.load_weights(9, *buckets_of(second))
    sample = worker.probe(PROBE, 4, 1.0, seed=1)
    assert sample.cached_prompt_tokens == 32
    stale = torch.tensor(sample.logprobs) - hf_logprobs(second, sample.prompt_ids, sample.response_ids)
    assert stale.abs().max() > 1e-3


def test_score_probe_scores_the_learners_sample_and_reports_cache_hits(worker, tiny_model_dir, monkeypatch):
    """The asynchronous probe: the engine's logprobs of a given sequence (vLLM prompt logprobs, raw logits) are the
    model's, and the one-token sample before them still sees a stale prefix cache."""
    ids = worker.tokenizer.encode(PROBE, add_special_tokens=False)
    response = worker.tokenizer.encode("8+8=16", add_special_tokens=False)
    first = perturbed_state(tiny_model_dir, seed=6)
    worker.load_weights(10, *buckets_of(first))
    sample = worker.score_probe(ids, response, [0.5] * len(response), seed=1)
    assert (sample.prompt_ids, sample.response_ids, sample.cached_prompt_tokens) == (ids, response, 0)
    assert list(sample.learner_logprobs) == [0.5] * len(response)  # handed through, for the driver to compare
    torch.testing.assert_close(torch.tensor(sample.logprobs), hf_logprobs(first, ids, response), atol=1e-4, rtol=0)
    assert worker.score_probe(ids, response, [], seed=1).cached_prompt_tokens == 32  # the sample reads the cache
    second = perturbed_state(tiny_model_dir, seed=7)
    monkeypatch.setattr(worker.engine, "reset_prefix_cache", lambda running=False: None)
    worker.load_weights(11, *buckets_of(second))
    stale = worker.score_probe(ids, response, [], seed=1)
    assert stale.cached_prompt_tokens == 32  # what the sync check stops the run for
    # The scored sequence itself is recomputed (vLLM skips the cache for prompt logprobs): the new weights'.
    torch.testing.assert_close(torch.tensor(stale.logprobs), hf_logprobs(second, ids, response), atol=1e-4, rtol=0)


def test_stepwise_generation_without_loads_is_generate_bit_for_bit(worker):
    """In-flight updates drive the engine a step at a time (`sample`'s `before_step`); with nothing to load, the same
    tokens and logprobs as `generate`, every token tagged with the version served."""
    ids = [worker.tokenizer.encode(p, add_special_tokens=False) for p in ("37+45=", PROBE)]
    ours = worker.engine.generate(ids, 3, 1.0, 1.0, 12, [4, 5])
    stepped = worker.engine.sample(ids, [Request(3, 1.0, 1.0, 12, seed) for seed in (4, 5)], before_step=lambda: 7)
    for group, again in zip(ours, stepped):
        for c, d in zip(group, again):
            assert (c.response_ids, c.logprobs, c.text, c.finish_reason) == (d.response_ids, d.logprobs, d.text,
                                                                              d.finish_reason)
            assert d.versions == [7] * len(d.response_ids)


@pytest.mark.parametrize("dtype,cpu_linear", [("float32", "torch"), ("bfloat16", "onednn")])
def test_in_flight_update_lands_between_two_engine_steps(tiny_model_dir, worker, dtype, cpu_linear):
    """An offer taken in the middle of a request: the tokens before it are the old weights' samples, the tokens
    after it the new weights' (running requests are preempted and their KV recomputed), each tagged with its version;
    the load is reported with the fingerprints of what the engine got, and probed after the request. Loaded in place
    (torch's linear) or through vLLM's reload (oneDNN's kernels)."""
    worker.shutdown()  # one engine at a time in this process
    w = RolloutWorker(EngineSettings(model_path=str(tiny_model_dir), dtype=dtype, cpu_linear=cpu_linear))
    assert w.engine.direct_loads == (cpu_linear == "torch")
    try:
        old, new = perturbed_state(tiny_model_dir, seed=8), perturbed_state(tiny_model_dir, seed=9)
        if dtype == "bfloat16":  # what the engine serves: the bfloat16 weights, compared in float32
            old, new = (m.to(torch.bfloat16).float() for m in (old, new))
        ids = w.tokenizer.encode(PROBE, add_special_tokens=False)
        response = w.tokenizer.encode("8+8=16", add_special_tokens=False)
        probe = (ids, response, hf_logprobs(new, ids, response).tolist(), 1)
        stepwise, calls = w.engine.generate_stepwise, []

        def offer_at_step_four(*args, **kwargs):
            *head, before_step = args

            def before():
                calls.append(1)
                if len(calls) == 4:
                    w.offer_weights(2, probe, *buckets_of(new))
                return before_step()
            return stepwise(*head, before, **kwargs)

        w.engine.generate_stepwise = offer_at_step_four
        sampling = SamplingSettings(group_size=2, max_new_tokens=12)
        groups = w.generate(["37+45=", "1+2="], [3, 4], sampling, 1, *buckets_of(old), in_flight=True)
        [(first, first_probe, during_first), (second, second_probe, during_second)] = groups.loads
        assert (first.version, first_probe, during_first) == (1, None, False)  # no probe was asked for version 1
        assert (second.version, during_second) == (2, True) and w.weights_version == 2
        assert second.fingerprints == (fingerprint(new.state_dict().items()),)
        assert second_probe.weights_version == 2 and second_probe.cached_prompt_tokens is None
        tol = 1e-4 if dtype == "float32" else 0.05
        assert max(abs(a - b) for a, b in zip(second_probe.logprobs, second_probe.learner_logprobs)) < tol
        both = 0
        for group in groups:
            for r in group:
                versions = list(r.versions)
                assert versions == sorted(versions) and set(versions) <= {1, 2} and r.weights_version == versions[0]
                both += len(set(versions)) == 2
                for model, version in ((old, 1), (new, 2)):
                    mine = [i for i, v in enumerate(versions) if v == version]
                    expected = hf_logprobs(model, r.prompt_ids, r.response_ids)[mine]
                    torch.testing.assert_close(torch.tensor(r.behavior_logprobs)[mine], expected, atol=tol, rtol=0)
        assert both, "no completion had tokens of both versions: the offer did not land mid-request"
        again = w.generate(["1+2="], [4], sampling, 1, *buckets_of(old), in_flight=True)
        assert again.loads == [] and {int(v) for r in again[0] for v in r.versions} == {2}  # never back to 1
    finally:
        w.shutdown()


@pytest.mark.parametrize("dtype,cpu_linear", [("float32", "onednn"), ("bfloat16", "torch")])
def test_the_probe_rides_in_its_request_with_the_bits_of_a_probe_alone(tiny_model_dir, worker, dtype, cpu_linear,
                                                                        monkeypatch):
    """vLLM's CPU backend is batch-invariant, so the sync probe runs as the first prompt of the request that loads
    the weights (one engine batch, not two): its tokens and logprobs are bit for bit those of the probe alone, which
    `stale_probe` compares across a worker's loads whatever else its requests held; its cache hits count only what
    survived the load, though the request's own prompts include the probe's. An engine that is not batch-invariant
    runs the probe alone first, with the same result. With either kernel of the CPU's linear layers; their
    completions do not depend on how a step is split between requests either (`assert_split_invariant`)."""
    worker.shutdown()  # one engine at a time in this process
    w = RolloutWorker(EngineSettings(model_path=str(tiny_model_dir), dtype=dtype, cpu_linear=cpu_linear))
    try:
        assert_split_invariant(w)
        args = (PROBE, 8, 1.0, 1)
        sampling = SamplingSettings(group_size=8, max_new_tokens=8)
        tol = 1e-4 if dtype == "float32" else 0.05
        for version, prompts in ((1, ["37+45="]), (2, ["37+45=", "1+2=", PROBE, "99+99="] * 8), (3, [PROBE])):
            model = perturbed_state(tiny_model_dir, seed=10 + version)
            if version == 3:
                monkeypatch.setattr(w.engine, "batch_invariant", False)
            groups = w.generate(prompts, list(range(len(prompts))), sampling, version, *buckets_of(model),
                                probe=SampleProbe(*args))
            assert len(groups) == len(prompts) and all(len(group) == 8 for group in groups)
            probed = groups.probe
            assert probed.weights_version == version and probed.cached_prompt_tokens == 0
            expected = hf_logprobs(model.to(torch.bfloat16).float() if dtype == "bfloat16" else model,
                                   probed.prompt_ids, probed.response_ids)
            torch.testing.assert_close(torch.tensor(probed.logprobs), expected, atol=tol, rtol=0)
            w.engine.reset_prefix_cache()
            alone = w.probe(*args)
            assert (alone.response_ids, alone.logprobs) == (probed.response_ids, probed.logprobs)
    finally:
        w.shutdown()


def _mark_head_kernel(vllm_worker) -> None:
    vllm_worker.model_runner.get_model().lm_head.cpu_linear.relay_mark = True


def _head_kernel(vllm_worker):
    """The CPU head's GEMM kernel (built from the head's weight when it was last processed), whether it is still the
    one `_mark_head_kernel` marked, and the padded vocabulary size."""
    model = vllm_worker.model_runner.get_model()
    kernel = model.lm_head.cpu_linear
    return kernel, getattr(kernel, "relay_mark", False), model.lm_head.weight


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_linear", ["onednn", "torch"])
def test_tied_embeddings_model_serves_the_new_weights(tiny_tied_model_dir, worker, dtype, cpu_linear):
    """Tied input/output embeddings: the checkpoint has no lm_head, so with oneDNN's kernels the CPU backend's packed
    head kernel must be rebuilt from the new embedding on every load. On CPUs whose packing copies the weight, a
    kernel left from the old load serves the old head, so besides the logprobs the test checks the kernel itself:
    replaced at every load, and computing with the new embedding (docs/vllm-cpu.md). With torch's linear the head's
    kernel is `torch_linear` on the embedding loaded in place."""
    worker.shutdown()  # one engine at a time in this process
    tied = RolloutWorker(EngineSettings(model_path=str(tiny_tied_model_dir), dtype=dtype, cpu_linear=cpu_linear))
    try:
        llm = tied.engine.llm
        assert tied.engine.direct_loads == (cpu_linear == "torch")
        sampling = SamplingSettings(group_size=1, max_new_tokens=6)
        for version, seed in ((1, 6), (2, 7)):
            if cpu_linear == "onednn":
                llm.collective_rpc(_mark_head_kernel)
            new = perturbed_state(tiny_tied_model_dir, seed=seed, scale=0.5)
            tied.load_weights(version, *buckets_of(new))
            [(kernel, still_marked, head)] = llm.collective_rpc(_head_kernel)
            if cpu_linear == "torch":
                assert kernel is torch_linear  # on the head's weight at each call: the embedding, loaded in place
            else:
                assert not still_marked, "the load left the head's kernel built from the previous weights"
            embedding = new.get_input_embeddings().weight.detach()
            x = torch.randn(5, embedding.shape[1], generator=torch.Generator().manual_seed(seed))
            served = kernel(x.to(head.dtype), head, None)[:, :embedding.shape[0]].float()
            expected = (x.to(head.dtype) @ embedding.to(head.dtype).T).float()
            torch.testing.assert_close(served, expected, atol=1e-4 if dtype == "float32" else 0.1, rtol=1e-2)
            [[r]] = tied.generate(["37+45="], [3], sampling)
            gap = (torch.tensor(r.behavior_logprobs) - hf_logprobs(new, r.prompt_ids, r.response_ids)).abs().max()
            assert gap < (1e-4 if dtype == "float32" else 0.2)
    finally:
        tied.shutdown()

