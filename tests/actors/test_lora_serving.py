"""LoRA with whole modules trained beside the adapters (`learner.lora.modules_to_save`, peft's), in-process on a tiny
Qwen2 with a real vLLM engine, in float32 and bfloat16: the output layer and the final norm train and sync with the
adapters, the engine serves them (its logprobs are the learner's after a load, and not without the modules), the
reference is the base without them, and names that are not whole layers outside the blocks are refused."""

from __future__ import annotations

import pytest
import torch

from actors.engine import EngineSettings, LoraServing, VllmEngine
from learner.config import LearnerConfig, LoraConfig
from learner.learner import Learner
from learner.lora import check_lora
from sync.publisher import cast_to_engine
from tests.actors.test_learner import PROMPTS, RESPONSES
from tests.actors.test_lora_learner import REWARDS, batch

WHOLE = ["lm_head", "model.norm"]
TOLERANCE = {"float32": 1e-4, "bfloat16": 2 ** -3}  # the sync probe's floors (docs/operations.md)


def engine_logprobs(engine: VllmEngine) -> list[list[float]]:
    """The engine's logprobs of each response token (prompt logprobs of prompt + response, at temperature 1)."""
    return [engine.score(list(p) + list(r))[-len(r):] for p, r in zip(PROMPTS, RESPONSES)]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_serves_the_whole_modules_trained_beside_the_adapters(tiny_model_dir, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    lora = LoraConfig(rank=8, modules_to_save=WHOLE, modules_lr=1e-2)
    config = LearnerConfig(lr=2e-2, warmup_steps=0, kl_coef=0.1, num_threads=1, lora=lora)
    learner = Learner(str(tiny_model_dir), config, dtype=dtype, seed=0, norm_length=4)
    adapters, modules = learner.optimizer.param_groups  # the whole modules at their own rate
    shape = learner.model.config
    assert (adapters["lr"], modules["lr"]) == (2e-2, 1e-2)
    assert sum(p.numel() for p in modules["params"]) == (shape.vocab_size + 1) * shape.hidden_size  # head + norm
    for rewards in REWARDS:
        learner.train_step(batch(learner, rewards))
    weights = learner.policy_state_dict()
    whole = {"base_model.model.lm_head.weight", "base_model.model.model.norm.weight"}
    assert {k for k in weights if ".lora_" not in k} == whole
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    for name in whole:  # trained: they moved away from the base's
        assert not torch.equal(weights[name], base[name.removeprefix("base_model.model.")]), name
    assert learner.num_trained_parameters()["policy"] == sum(v.numel() for v in weights.values())
    policy = learner.compute_logprobs(PROMPTS, RESPONSES, temperature=1.0)
    with learner.model.disable_adapter():  # the reference: the base, its own output layer and norm included
        reference = learner.compute_logprobs(PROMPTS, RESPONSES, temperature=1.0)

    serving = LoraServing(lora.rank, lora.scale_alpha, tuple(check_lora(lora, AutoConfig.from_pretrained(
        tiny_model_dir))))
    engine = VllmEngine(EngineSettings(model_path=str(tiny_model_dir), dtype=dtype, lora=serving))
    try:
        assert max_diff(engine_logprobs(engine), reference) <= TOLERANCE[dtype]  # before any load: the base
        sent = cast_to_engine(weights, getattr(torch, dtype))
        engine.load_weights((k, v) for k, v in sent.items() if ".lora_" in k)  # the adapters without the modules
        assert max_diff(engine_logprobs(engine), policy) > 4 * TOLERANCE[dtype]  # the modules matter
        engine.load_weights(sent.items())  # a sync: the adapters and the whole modules
        assert max_diff(engine_logprobs(engine), policy) <= TOLERANCE[dtype]
    finally:
        engine.shutdown()


def test_whole_modules_must_be_layers_outside_the_blocks_and_untied(tiny_model_dir, tiny_tied_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert check_lora(LoraConfig(rank=4, modules_to_save=WHOLE), config)
    for name in ["norm", "model", "model.layers.0.input_layernorm", "model.layers.0.mlp"]:
        with pytest.raises(ValueError, match=f"modules_to_save: '{name}' is not a layer with weights outside"):
            check_lora(LoraConfig(rank=4, modules_to_save=[name]), config)
    tied = AutoConfig.from_pretrained(tiny_tied_model_dir)
    with pytest.raises(ValueError, match="'lm_head' shares its weights with another layer"):
        check_lora(LoraConfig(rank=4, modules_to_save=["lm_head"]), tied)
