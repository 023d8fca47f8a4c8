"""Learner checkpoints in-process on the tiny model: a restored learner continues bitwise like the original, the
state file loads without arbitrary unpickling, and the saved policy is the learner's policy for plain transformers
and for a fresh vLLM engine."""

from __future__ import annotations

import pytest
import torch

from learner.batch import TrainBatch
from learner.config import CriticConfig, LearnerConfig
from learner.learner import Learner
from learner.passes.sequences import pad_sequences, sequence_logprobs

PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 12, 4, 15]] * 2  # "37+45=" x2, "1+2=" x2 (char ids)
RESPONSES = [[12, 2, 1], [4, 4, 1], [5, 1], [9, 1]]
REWARDS = ([1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0])
FIXED = ([5, 9, 12, 6, 7, 15], [12, 2, 1])  # "37+45=" -> "82<eos>"


# (model.dtype, learner.master_dtype): float32; bfloat16 compute on float32 master weights; pure bfloat16.
PRECISIONS = {"float32": ("float32", "float32"), "bfloat16": ("bfloat16", "float32"),
              "bfloat16-master": ("bfloat16", "bfloat16")}


def make_learner(model_dir, gae: bool = False, precision: str = "float32") -> Learner:
    # Adam as configured, with a warm-up so the scheduler's position matters, and 2 minibatches so the shuffle does.
    dtype, master = PRECISIONS[precision]
    config = LearnerConfig(lr=1e-2, warmup_steps=3, num_minibatches=2, kl_coef=0.0, num_threads=2,
                           advantage="gae" if gae else "grpo", master_dtype=master)
    critic = CriticConfig(enabled=True, lr=1e-2, warmup_steps=3) if gae else None
    return Learner(str(model_dir), config, dtype=dtype, seed=0, critic=critic, norm_length=4)


def train(learner: Learner, rewards) -> dict[str, float]:
    batch = TrainBatch(PROMPTS, RESPONSES, learner.compute_logprobs(PROMPTS, RESPONSES), list(rewards), 2)
    metrics = learner.train_step(batch)
    return {k: v for k, v in metrics.items() if not k.startswith("memory/")}  # process-wide, not the learner's


def learner_logprobs(learner: Learner) -> torch.Tensor:
    batch = pad_sequences([FIXED[0]], [FIXED[1]], learner.pad_id)
    with torch.no_grad():
        return sequence_logprobs(learner.model, batch)[batch.response_mask.bool()]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A learner after two Adam steps and its checkpoint directory."""
    learner = make_learner(tiny_model_dir)
    for rewards in REWARDS[:2]:
        train(learner, rewards)
    directory = tmp_path_factory.mktemp("ckpt")
    learner.save_checkpoint(str(directory))
    return learner, directory


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("gae", [False, True], ids=["grpo", "gae-with-critic"])
def test_restored_learner_continues_bitwise_like_the_original(tiny_model_dir, tmp_path, gae, precision):
    original = make_learner(tiny_model_dir, gae, precision)
    for rewards in REWARDS[:2]:
        train(original, rewards)
    original.save_checkpoint(str(tmp_path))
    restored = make_learner(tiny_model_dir, gae, precision)
    torch.manual_seed(123)  # a different global RNG state, which the load must put back
    assert restored.load_checkpoint(str(tmp_path)) == 2
    assert torch.equal(restored.shuffle.get_state(), original.shuffle.get_state())

    assert train(restored, REWARDS[2]) == train(original, REWARDS[2])
    models = [(original.model, restored.model)] + ([(original.critic.model, restored.critic.model)] if gae else [])
    for a, b in models:
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), name
    assert restored.weights_version == original.weights_version == 3
    assert restored.scheduler.get_last_lr() == original.scheduler.get_last_lr()


def test_mixed_precision_checkpoint_keeps_the_float32_master_weights_beside_a_bfloat16_policy(tiny_model_dir,
                                                                                             tmp_path):
    """The policy directory is what vLLM and transformers serve (model.dtype); the master weights the update continues
    from are in the learner's state, and a resume that read the bfloat16 directory instead would not be exact."""
    import json

    from safetensors.torch import load_file

    learner = make_learner(tiny_model_dir, gae=True, precision="bfloat16")
    for rewards in REWARDS[:2]:
        train(learner, rewards)
    learner.save_checkpoint(str(tmp_path))
    policy = load_file(next((tmp_path / "policy").glob("*.safetensors")))
    assert {t.dtype for t in policy.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    state = torch.load(tmp_path / "learner_state.pt", weights_only=True)
    for name, tensor in learner.model.state_dict().items():
        master = state["master_weights"][name]
        assert master.dtype == torch.float32 and torch.equal(master, tensor)
        if name in policy:
            assert torch.equal(policy[name], tensor.to(torch.bfloat16))
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in learner.model.state_dict().values())
    critic = load_file(next((tmp_path / "critic").glob("*.safetensors")))
    assert {t.dtype for t in critic.values()} == {torch.float32}  # the value model is never served: its master


def test_a_fresh_learner_differs_without_the_restored_state(tiny_model_dir, trained):
    """The check above has teeth: weights alone (fresh Adam moments, schedule and shuffle) give another step."""
    original, directory = trained
    from learner.critic import load_model_weights

    fresh = make_learner(tiny_model_dir)
    load_model_weights(fresh.model, directory / "policy")
    assert torch.equal(learner_logprobs(fresh), learner_logprobs(original))
    train(fresh, REWARDS[2])
    assert not torch.equal(learner_logprobs(fresh), learner_logprobs(original))


def test_learner_state_loads_without_arbitrary_unpickling(trained):
    _, directory = trained
    state = torch.load(directory / "learner_state.pt", weights_only=True)
    assert state["weights_version"] == 2 and state["nonfinite_in_row"] == 0 and state["critic"] is None
    assert state["scheduler"]["last_epoch"] == 4 and state["scheduler"]["lr_lambdas"] == [None]  # 2 steps x 2 mbs
    assert all(float(s["step"]) == 4 for s in state["optimizer"]["state"].values())
    assert {"shuffle", "torch"} == set(state["rng"])


def test_saved_policy_loads_with_plain_transformers(trained, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner, directory = trained
    model = AutoModelForCausalLM.from_pretrained(directory / "policy", dtype=torch.float32)
    batch = pad_sequences([FIXED[0]], [FIXED[1]], learner.pad_id)
    with torch.no_grad():
        theirs = sequence_logprobs(model, batch)[batch.response_mask.bool()]
    ours = learner_logprobs(learner)
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=0)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        assert (sequence_logprobs(initial, batch)[batch.response_mask.bool()] - ours).abs().max() > 1e-2  # trained
    tokenizer = AutoTokenizer.from_pretrained(directory / "policy")
    assert tokenizer.encode("37+45=", add_special_tokens=False) == FIXED[0]


def test_tied_embeddings_round_trip(tiny_tied_model_dir, tmp_path):
    """save_pretrained writes a tied head once; loading must accept that and keep the tie."""
    original = make_learner(tiny_tied_model_dir)
    train(original, REWARDS[0])
    original.save_checkpoint(str(tmp_path))
    restored = make_learner(tiny_tied_model_dir)
    restored.load_checkpoint(str(tmp_path))
    assert restored.model.lm_head.weight.data_ptr() == restored.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(learner_logprobs(restored), learner_logprobs(original))


def test_loading_into_a_learner_of_another_kind_is_refused(tiny_model_dir, trained):
    _, directory = trained
    with pytest.raises(ValueError, match="has no value model but this run has"):
        make_learner(tiny_model_dir, gae=True).load_checkpoint(str(directory))


@pytest.mark.slow
def test_saved_policy_serves_from_a_fresh_vllm_engine(trained):
    from actors.engine import EngineSettings
    from actors.rollout import RolloutWorker

    learner, directory = trained
    worker = RolloutWorker(EngineSettings(model_path=str(directory / "policy")))
    try:
        prompt_ids, response_ids, engine_lps, *_ = worker.probe("37+45=", 6, 1.0, seed=1)
    finally:
        worker.shutdown()
    assert prompt_ids == FIXED[0] and len(response_ids) >= 1
    [ours] = learner.compute_logprobs([prompt_ids], [response_ids])
    torch.testing.assert_close(torch.tensor(engine_lps), torch.tensor(ours), atol=1e-4, rtol=0)
