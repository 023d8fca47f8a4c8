"""Device placement of the torch-side actors (Learner with its Critic, ReferenceWorker, RewardModelWorker), on CPU.

Without a GPU, two checks stand in for one:
- models go where `pick_device` says: patched to "meta" (no data, nothing computed), every parameter must be there;
- nothing assumes the CPU: with torch's default device set to "meta", a tensor built without naming its device
  lands on "meta", where it can neither meet the model's CPU tensors nor be read back. So a step that still gives
  exactly the plain step's results built every tensor beside the model (or named the CPU on purpose) - on a GPU
  node the same tensor would have been a CPU tensor next to a CUDA model.
tests/gpu/test_gpu.py compares real CUDA results with these CPU ones.
"""

from __future__ import annotations

import pytest
import torch

import actors.reference
import actors.reward_model
import learner.critic
import learner.learner
from actors.reference import ReferenceWorker
from actors.reward_model import RewardModelWorker
from learner.batch import TrainBatch
from learner.config import CriticConfig, LearnerConfig
from learner.learner import Learner
from learner.passes.micro_batches import MicroBatching

PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 12, 4, 15]] * 2  # "37+45=" x2, "1+2=" x2 (char ids)
RESPONSES = [[12, 2, 1], [4, 4, 1], [5, 1], [9, 1]]
TEXT_PROMPTS = ["37+45=", "1+2=", "99+99="]
COMPLETIONS = ["82", "3", "198 and some more"]
META = torch.device("meta")
# Every module whose class places a model; a new one must be added here or the first test fails for it.
PLACING_MODULES = (learner.learner, learner.critic, actors.reference, actors.reward_model)


def make_learner(model_dir, advantage: str, **overrides) -> Learner:
    config = LearnerConfig(lr=1e-2, num_threads=2, advantage=advantage, micro_batch_size=2, num_minibatches=2,
                           entropy_coef=0.01, **overrides)
    critic = CriticConfig(enabled=True, lr=1e-2) if advantage == "gae" else None
    return Learner(str(model_dir), config, seed=0, critic=critic, norm_length=4)


def tensors_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def test_every_actor_puts_its_models_on_the_picked_device(tiny_model_dir, tiny_reward_model_dir, monkeypatch):
    for module in PLACING_MODULES:
        monkeypatch.setattr(module, "pick_device", lambda: META)
    policy = make_learner(tiny_model_dir, "gae")
    reference = ReferenceWorker(str(tiny_model_dir))
    reward_model = RewardModelWorker(str(tiny_reward_model_dir))
    models = {"policy": policy.model, "critic": policy.critic.model, "reference": reference.model,
              "reward model": reward_model.model}
    for name, model in models.items():
        assert {t.device for t in tensors_of(model)} == {META}, name
    assert policy.device == policy.critic.device == reference.device == reward_model.device == META
    # The optimizers were built on the moved parameters, so their state will be made beside them.
    assert all(p.device == META for group in policy.optimizer.param_groups for p in group["params"])
    assert all(p.device == META for group in policy.critic.optimizer.param_groups for p in group["params"])


@pytest.mark.parametrize("advantage, kl", [("grpo", {"kl_coef": 0.1}),  # KL in the loss
                                            ("gae", {"kl_coef": 0.0, "kl_reward_coef": 0.1})])  # in the reward
def test_a_step_builds_every_tensor_beside_the_model(tiny_model_dir, advantage, kl):
    ref = ReferenceWorker(str(tiny_model_dir)).compute_logprobs(PROMPTS, RESPONSES)
    plain, guarded = (make_learner(tiny_model_dir, advantage, **kl) for _ in range(2))
    results = []
    for learner_, default in ((plain, torch.device("cpu")), (guarded, META)):
        assert learner_.device == torch.device("cpu")
        # First step as usual: AdamW makes its step counters on the default device (torch's own CPU scalars).
        batch = TrainBatch(PROMPTS, RESPONSES, learner_.compute_logprobs(PROMPTS, RESPONSES), [1.0, 0.0, 0.5, 1.0],
                           2, ref)
        learner_.train_step(batch)
        with default:
            behavior = learner_.compute_logprobs(PROMPTS, RESPONSES)
            metrics = learner_.train_step(TrainBatch(PROMPTS, RESPONSES, behavior, [0.0, 1.0, 1.0, 0.0], 2, ref))
            after = learner_.compute_logprobs(PROMPTS, RESPONSES)
        results.append(({k: v for k, v in metrics.items() if not k.startswith("memory/")}, behavior, after))
    assert results[0] == results[1]  # bitwise: the same CPU arithmetic, and nothing was left on "meta"
    assert results[1][0]["grad_norm"] > 0 and results[1][1] != results[1][2]  # the guarded step did update


def test_reference_and_reward_model_build_every_tensor_beside_the_model(tiny_model_dir, tiny_reward_model_dir):
    reference = ReferenceWorker(str(tiny_model_dir), batching=MicroBatching(3))
    shared = ReferenceWorker(str(tiny_model_dir), batching=MicroBatching(3, share_prompts=True))
    reward_model = RewardModelWorker(str(tiny_reward_model_dir), batching=MicroBatching(2))
    expected = (reference.compute_logprobs(PROMPTS, RESPONSES), reward_model.score(TEXT_PROMPTS, COMPLETIONS),
                shared.compute_logprobs(PROMPTS, RESPONSES))
    with torch.device(META):
        got = (reference.compute_logprobs(PROMPTS, RESPONSES), reward_model.score(TEXT_PROMPTS, COMPLETIONS),
               shared.compute_logprobs(PROMPTS, RESPONSES))
    assert got == expected
    assert all(isinstance(v, float) for row in got[0] for v in row) and all(isinstance(s, float) for s in got[1])
