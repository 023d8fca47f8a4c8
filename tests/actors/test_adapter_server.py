"""`AdapterServer` (one vLLM engine serving several LoRA adapters at once: `relay serve`'s models share it), in-process
on a tiny Qwen2 with a real engine, in float32 and bfloat16: two models' adapters of different ranks, trained apart,
each sample with their own adapters (the engine's logprobs of the sampled tokens are that model's learner's, not the
other's), a new load of one leaves the other as it was, a slot is freed by `forget`, and too many adapters or too high
a rank are refused."""

from __future__ import annotations

import pytest

from actors.adapter_server import AdapterServer
from actors.engine import EngineSettings, LoraServing
from actors.rollout_types import SamplingSettings
from learner.config import LearnerConfig, LoraConfig
from learner.datums import Datum, DatumLearner
from learner.lora import check_lora

TOLERANCE = {"float32": 1e-4, "bfloat16": 2 ** -3}  # the sync probe's floors (docs/operations.md)
PROMPTS = [[3, 7, 9], [5, 4], [12, 6, 8, 2]]


def trained(model_dir, dtype: str, rank: int, seed: int, steps: int) -> DatumLearner:
    """A LoRA model of rank `rank`, moved away from the base by `steps` supervised steps on a row of its own."""
    config = LearnerConfig(lr=5e-2, warmup_steps=0, num_threads=1, lora=LoraConfig(rank=rank))
    model = DatumLearner(str(model_dir), config, dtype=dtype, seed=seed)
    row = [3, 7, 9, 4 + seed, 12, 5 + seed]
    for _ in range(steps):
        model.forward_backward([Datum(row[:-1], row[1:], [0, 0, 1, 1, 1])], "cross_entropy")
        model.optim_step(5e-2, 0.9, 0.95, 1e-8)
    return model


def learner_logprobs(model: DatumLearner, prompt: list[int], response: list[int]) -> list[float]:
    [row], _ = model.forward_backward([Datum(prompt + response[:-1], prompt[1:] + response)], "cross_entropy",
                                      forward_only=True)
    return row[len(prompt) - 1:]


def load(server: AdapterServer, name: str, model: DatumLearner) -> None:
    lora = model.learner.config.lora
    loaded = server.load(name, model.weights_version(), lora.rank, lora.scale_alpha, *model.export_weights(2**20))
    assert loaded.fingerprints == (model.weights_fingerprint(),)  # the engine got exactly what the learner sent


def largest_gap(server: AdapterServer, name: str, model: DatumLearner) -> float:
    """The largest |engine - learner| logprob over samples of every prompt with adapters `name`."""
    groups = server.generate(name, PROMPTS, [11, 12, 13], SamplingSettings(group_size=2, max_new_tokens=4))
    assert {r.weights_version for g in groups for r in g} == {server.versions[name]}
    return max(abs(a - b) for prompt, group in zip(PROMPTS, groups) for r in group
               for a, b in zip(r.behavior_logprobs, learner_logprobs(model, prompt, list(r.response_ids))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_several_models_sample_with_their_own_adapters_on_one_engine(tiny_model_dir, dtype):
    from transformers import AutoConfig

    first, second = trained(tiny_model_dir, dtype, 4, 0, 3), trained(tiny_model_dir, dtype, 8, 1, 3)
    targets = tuple(check_lora(LoraConfig(rank=8), AutoConfig.from_pretrained(tiny_model_dir)))
    settings = EngineSettings(model_path=str(tiny_model_dir), dtype=dtype,
                              lora=LoraServing(8, 16.0, targets, max_loras=2))
    server = AdapterServer(settings)
    try:
        load(server, "first", first)
        load(server, "second", second)
        tol = TOLERANCE[dtype]
        assert largest_gap(server, "first", first) <= tol
        assert largest_gap(server, "second", second) <= tol
        assert largest_gap(server, "first", second) > 4 * tol  # the adapters differ: a mix-up would show
        first.forward_backward([Datum([5, 4, 9], [4, 9, 9], [1, 1, 1])], "cross_entropy")  # the first trains on
        first.optim_step(5e-2, 0.9, 0.95, 1e-8)
        load(server, "first", first)
        assert server.versions == {"first": 4, "second": 3}
        assert largest_gap(server, "first", first) <= tol
        assert largest_gap(server, "second", second) <= tol  # untouched by the other's load
        with pytest.raises(ValueError, match="serves 2 adapters at most"):
            load(server, "third", first)
        server.forget("second")
        with pytest.raises(KeyError, match="no adapters named 'second'"):
            largest_gap(server, "second", second)
        wide = trained(tiny_model_dir, dtype, 16, 2, 0)
        with pytest.raises(ValueError, match="adapters of rank 16 exceed the engine's 8"):
            load(server, "wide", wide)
        load(server, "third", second)  # the freed slot
        assert largest_gap(server, "third", second) <= tol
    finally:
        server.shutdown()
