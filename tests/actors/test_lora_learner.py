"""The Learner with LoRA adapters (`learner.lora`), in-process on a tiny random Qwen2, in float32 and bfloat16: only the
adapters train and have AdamW state, only they are published (and counted in `sync/bytes`), the reference is the base
(the adapters disabled) exactly as a reference worker computes it, a checkpoint holds the adapters in peft's format and
resumes bit for bit, dropout is in the training passes only (pi_old included), and `relay export --merge`'s model
(with the whole modules trained beside the adapters, `learner.lora.modules_to_save`) gives the policy's logprobs."""

from __future__ import annotations

import json

import pytest
import torch

from actors.reference import ReferenceWorker
from cluster.run.export import export_checkpoint
from learner.batch import TrainBatch
from learner.config import LearnerConfig, LoraConfig
from learner.learner import Learner
from learner.lora import check_lora, lora_targets
from tests.actors.test_learner import PROMPTS, RESPONSES

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
QWEN2_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def make(model_dir, dtype: str = "float32", kl_coef: float = 0.1, **lora) -> Learner:
    config = LearnerConfig(lr=2e-2, warmup_steps=0, kl_coef=kl_coef, num_threads=2,
                           lora=LoraConfig(**{"rank": 8, **lora}))
    return Learner(str(model_dir), config, dtype=dtype, seed=0, norm_length=4)


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def batch(learner: Learner, rewards, ref=None) -> TrainBatch:
    return TrainBatch(PROMPTS, RESPONSES, learner.compute_logprobs(PROMPTS, RESPONSES), list(rewards), 2, ref)


def test_targets_resolve_on_the_model_and_unknown_names_are_refused(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert check_lora(LoraConfig(rank=4), config) == QWEN2_LINEAR  # all-linear: the blocks' projections, no head
    assert check_lora(LoraConfig(rank=4, target_modules=["v_proj", "q_proj"]), config) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="'lm_head' matches no linear layer"):
        check_lora(LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]), config)
    with pytest.raises(ValueError, match="'mlp' matches no linear layer"):
        check_lora(LoraConfig(rank=4, target_modules=["mlp"]), config)  # a module, but not a linear layer
    with pytest.raises(ValueError, match="nothing LoRA can adapt"):
        lora_targets(torch.nn.Sequential(torch.nn.Linear(2, 2)), "all-linear")  # no decoder blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_the_adapters_train_publish_and_hold_optimizer_state(tiny_model_dir, dtype):
    learner = make(tiny_model_dir, dtype)
    base = {k: v.clone() for k, v in learner.model.state_dict().items() if "lora_" not in k}
    adapters = learner.policy_state_dict()
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert sorted({k.split(".")[-3] for k in adapters}) == QWEN2_LINEAR
    assert all(v.dtype == torch.float32 for v in adapters.values())  # the master dtype: what AdamW updates
    trained = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    assert learner.num_trained_parameters()["policy"] == trained == sum(v.numel() for v in adapters.values())
    for rewards in REWARDS:
        metrics = learner.train_step(batch(learner, rewards))
    assert metrics["train/skipped_updates"] == 0 and metrics["kl/mean"] > 0  # the adapters moved the policy
    # The engines get the adapters alone, in model.dtype: sync/bytes counts them.
    assert metrics["sync/bytes"] == trained * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    assert all(torch.equal(base[k], v) for k, v in learner.model.state_dict().items() if "lora_" not in k)
    state = learner.optimizer.state_dict()["state"]
    assert sum(s["exp_avg"].numel() for s in state.values()) == trained  # AdamW state for the adapters only
    assert learner.weights_fingerprint().keys() == adapters.keys()  # the sync check covers what is sent


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reference_is_the_base_with_the_adapters_disabled(tiny_model_dir, dtype):
    """A LoRA run has no reference worker: the learner computes the base's logprobs itself. They are a reference
    worker's on the base model (the update with them equals the update with the worker's), and they stay the base's
    after the adapters moved."""
    reference = ReferenceWorker(str(tiny_model_dir), dtype)
    own, given = make(tiny_model_dir, dtype), make(tiny_model_dir, dtype)
    # bfloat16: the worker runs its bfloat16 copy of the weights, the learner autocasts its float32 masters.
    close = dict(rel=1e-5, abs=1e-8) if dtype == "float32" else dict(rel=0.05, abs=1e-5)
    for rewards in REWARDS:
        ref = reference.compute_logprobs(PROMPTS, RESPONSES)
        metrics_own = own.train_step(batch(own, rewards))  # no reference logprobs given: the base's, computed here
        metrics_given = given.train_step(batch(given, rewards, ref))
        assert metrics_own["kl/mean"] == pytest.approx(metrics_given["kl/mean"], **close)
    assert metrics_own["kl/mean"] > 100 * close["abs"]
    if dtype == "float32":  # in bfloat16 Adam's sign-like first steps make the reference's rounding visible
        for a, b in zip(own.policy_state_dict().values(), given.policy_state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # Without adapters (rank 0) nothing is computed in their place: the KL needs reference logprobs from outside.
    full = Learner(str(tiny_model_dir), LearnerConfig(kl_coef=0.1, num_threads=2), dtype=dtype, seed=0)
    assert not full.base_reference and own.base_reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_holds_the_adapters_in_peft_format_and_resumes_bit_for_bit(tiny_model_dir, tmp_path, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = make(tiny_model_dir, dtype)
    learner.train_step(batch(learner, REWARDS[0]))
    learner.save_checkpoint(str(tmp_path))
    policy = tmp_path / "policy"
    assert sorted(p.name for p in policy.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((policy / "adapter_config.json").read_text())["r"] == 8
    resumed = make(tiny_model_dir, dtype)
    assert resumed.load_checkpoint(str(tmp_path)) == 1
    for rewards in REWARDS[1:]:
        data = batch(learner, rewards)
        assert learner.train_step(data) == resumed.train_step(data)  # every metric, bit for bit
    for (name, a), b in zip(learner.policy_state_dict().items(), resumed.policy_state_dict().values()):
        assert torch.equal(a, b), name
    # peft loads the directory as it is: the adapters of the saved policy.
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(policy))
    saved = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(learner.policy_state_dict())
    # A full fine-tuning learner refuses it in one line, and a LoRA learner refuses a full checkpoint.
    full = Learner(str(tiny_model_dir), LearnerConfig(kl_coef=0.0, num_threads=2), dtype=dtype, seed=0)
    with pytest.raises(ValueError, match="has LoRA adapters but this run has none"):
        full.load_checkpoint(str(tmp_path))
    full.save_checkpoint(str(tmp_path / "full"))
    with pytest.raises(ValueError, match="has no LoRA adapters but this run has"):
        make(tiny_model_dir, dtype).load_checkpoint(str(tmp_path / "full"))


def test_dropout_is_in_the_training_passes_only(tiny_model_dir):
    dropped, plain = make(tiny_model_dir, dropout=0.5), make(tiny_model_dir)
    before = dropped.compute_logprobs(PROMPTS, RESPONSES)
    assert before == dropped.compute_logprobs(PROMPTS, RESPONSES) == plain.compute_logprobs(PROMPTS, RESPONSES)
    for learner in (dropped, plain):
        learner.train_step(batch(learner, REWARDS[0]))
        learner.train_step(batch(learner, REWARDS[1]))  # the adapters' B is non-zero now: dropout changes outputs
    assert dropped.compute_logprobs(PROMPTS, RESPONSES) == dropped.compute_logprobs(PROMPTS, RESPONSES)  # no dropout
    grads = []
    for learner in (dropped, plain):
        learner.train_step(batch(learner, REWARDS[2]))
        grads.append(learner.policy_state_dict())
    assert any(not torch.equal(a, b) for a, b in zip(grads[0].values(), grads[1].values()))
    assert all(not m.training for m in dropped.model.modules())  # eval mode restored after the update


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("correction", ["tis", "icepop"])
def test_old_logprobs_are_the_policy_without_dropout(tiny_model_dir, dtype, correction):
    """pi_old is the policy the engines serve, without dropout, also when the batch gets one update (where it would
    otherwise come from the training forward, which drops): behavior logprobs from an eval-mode forward equal it bit
    for bit, so logprob/mismatch and mismatch/kl are 0 and every correction weight is 1."""
    config = LearnerConfig(lr=2e-2, warmup_steps=0, kl_coef=0.1, num_threads=2, rollout_correction=correction,
                           lora=LoraConfig(rank=8, dropout=0.5))
    learner = Learner(str(tiny_model_dir), config, dtype=dtype, seed=0, norm_length=4)
    for rewards in REWARDS[:2]:
        learner.train_step(batch(learner, rewards))  # the adapters' B is non-zero now: dropout changes outputs
    metrics = learner.train_step(batch(learner, REWARDS[2]))  # behavior: compute_logprobs, an eval-mode forward
    assert metrics["logprob/mismatch"] == 0.0 and metrics["mismatch/kl"] == 0.0
    assert metrics["rollout_correction/weight_mean"] == 1.0
    share = "rollout_correction/capped_fraction" if correction == "tis" else "rollout_correction/masked_fraction"
    assert metrics[share] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_merges_the_adapters_into_a_model_with_the_policys_logprobs(tiny_model_dir, tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    from learner.passes.sequences import pad_sequences, sequence_logprobs, unpad_per_token

    learner = make(tiny_model_dir, dtype, modules_to_save=["lm_head", "model.norm"])  # trained whole beside them
    for rewards in REWARDS:
        learner.train_step(batch(learner, rewards))
    checkpoint = tmp_path / "step_3"
    checkpoint.mkdir()
    learner.save_checkpoint(str(checkpoint))
    for name, text in [("driver_state.json", '{"step": 3, "weights_version": 3}'), ("COMPLETE", "3\n"),
                       ("config.yaml", f"model:\n  dtype: {dtype}\n")]:
        (checkpoint / name).write_text(text)
    assert "merged" in export_checkpoint(checkpoint, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in k or "modules_to_save" in k for k in merged.state_dict())
    trained = learner.policy_state_dict()
    for name in ["lm_head.weight", "model.norm.weight"]:  # the merge holds the trained whole modules, cast
        assert torch.equal(merged.state_dict()[name], trained[f"base_model.model.{name}"].to(dtype_of(dtype)).float())
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == dtype
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    rows = pad_sequences(PROMPTS, RESPONSES, 0, torch.device("cpu"))
    with torch.no_grad():
        exported = unpad_per_token(sequence_logprobs(merged, rows, 1.0), rows)
    policy = learner.compute_logprobs(PROMPTS, RESPONSES)
    tolerance = 1e-5 if dtype == "float32" else 0.05  # a bfloat16 cast of the merged weights vs base + adapters
    for a, b in zip(exported, policy):
        assert max(abs(x - y) for x, y in zip(a, b)) < tolerance
    assert "peft format" in export_checkpoint(checkpoint, tmp_path / "adapters", merge=False)
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
