"""`DatumLearner` (the Tinker API's learner side), in-process on a tiny random Qwen2 with LoRA, in float32 and bfloat16:
its target logprobs are the learner's own (`Learner.compute_logprobs`), gradients accumulate over `forward_backward`
calls until `optim_step`, weighted cross-entropy falls, importance sampling at ratio 1 is REINFORCE, and an unknown
loss or a malformed datum is refused before any gradient changes."""

from __future__ import annotations

import math

import pytest
import torch

from learner.config import LearnerConfig, LoraConfig
from learner.datums import Datum, DatumLearner

ROW = [3, 7, 9, 4, 12, 5]  # a prompt of 3 tokens, then a response of 3


def make(model_dir, dtype: str) -> DatumLearner:
    config = LearnerConfig(lr=1e-2, warmup_steps=0, num_threads=2, lora=LoraConfig(rank=4))
    return DatumLearner(str(model_dir), config, dtype=dtype, seed=0)


def datum(weights=None, advantages=None, behavior=None) -> Datum:
    return Datum(ROW[:-1], ROW[1:], weights, advantages, behavior)


def grads(dl: DatumLearner) -> list[torch.Tensor]:
    return [p.grad.clone() for p in dl.learner.model.parameters() if p.requires_grad and p.grad is not None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_target_logprobs_are_the_learners_own(tiny_model_dir, dtype):
    dl = make(tiny_model_dir, dtype)
    [rows], metrics = dl.forward_backward([datum([0, 0, 1, 1, 1])], "cross_entropy", forward_only=True)
    [response] = dl.learner.compute_logprobs([ROW[:3]], [ROW[3:]], temperature=1.0)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert rows[2:] == pytest.approx(response, abs=tol)
    assert metrics["loss:sum"] == pytest.approx(-sum(rows[2:]), abs=1e-4)
    assert not grads(dl)  # forward only: no gradient


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_accumulate_until_the_step_and_the_loss_falls(tiny_model_dir, dtype):
    dl = make(tiny_model_dir, dtype)
    weights = [0, 0, 1, 1, 1]
    dl.forward_backward([datum(weights)], "cross_entropy")
    once = grads(dl)
    dl.forward_backward([datum(weights)], "cross_entropy")
    for g1, g2 in zip(once, grads(dl), strict=True):
        torch.testing.assert_close(g2, 2 * g1)
    first = dl.forward_backward([datum(weights)], "cross_entropy", forward_only=True)[1]["loss:sum"]
    dl.optim_step(1e-2, 0.9, 0.95, 1e-8)
    assert not grads(dl) and dl.weights_version() == 1
    for _ in range(4):
        dl.forward_backward([datum(weights)], "cross_entropy")
        dl.optim_step(1e-2, 0.9, 0.95, 1e-8)
    last = dl.forward_backward([datum(weights)], "cross_entropy", forward_only=True)[1]["loss:sum"]
    assert last < first - 0.5


def test_importance_sampling_at_ratio_one_is_weighted_cross_entropy(tiny_model_dir):
    dl = make(tiny_model_dir, "float32")
    [rows], _ = dl.forward_backward([datum()], "cross_entropy", forward_only=True)
    adv = [0.0, 0.0, 2.0, -1.0, 0.5]
    dl.forward_backward([datum(advantages=adv, behavior=rows)], "importance_sampling")
    reinforce = grads(dl)
    dl.learner.optimizer.zero_grad(set_to_none=True)
    dl.forward_backward([datum(weights=adv)], "cross_entropy")  # d/dθ of -sum A log pi = -sum A grad log pi at ratio 1
    for g1, g2 in zip(reinforce, grads(dl), strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_unknown_loss_and_bad_datum_are_refused_without_gradients(tiny_model_dir):
    dl = make(tiny_model_dir, "float32")
    with pytest.raises(ValueError, match="loss_fn 'dro' is not supported"):
        dl.forward_backward([datum()], "dro")
    with pytest.raises(ValueError, match="target_tokens has 4 tokens"):
        dl.forward_backward([Datum(ROW[:-1], ROW[1:-1])], "cross_entropy")
    assert not grads(dl)


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_ppo_and_cispo_are_relays_losses_summed_over_the_datum(tiny_model_dir, loss):
    dl = make(tiny_model_dir, "float32")
    [rows], _ = dl.forward_backward([datum()], "cross_entropy", forward_only=True)
    # Every ratio pi/q is 2, over the clip's 1.2: ppo's loss is -1.2 A_t per token (no gradient), cispo's
    # -1.2 A_t log pi (the gradient of REINFORCE, weighted 1.2).
    behavior = [lp - math.log(2.0) for lp in rows]
    adv = [1.0, 1.0, 1.0, 1.0, 2.0]
    _, metrics = dl.forward_backward([datum(advantages=adv, behavior=behavior)], loss, config={})
    expected = -1.2 * sum(adv) if loss == "ppo" else -1.2 * sum(a * lp for a, lp in zip(adv, rows, strict=True))
    assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    clipped = grads(dl)
    if loss == "ppo":
        assert all(torch.count_nonzero(g) == 0 for g in clipped)
    else:
        dl.learner.optimizer.zero_grad(set_to_none=True)
        dl.forward_backward([datum(weights=[1.2 * a for a in adv])], "cross_entropy")
        for g1, g2 in zip(clipped, grads(dl), strict=True):
            torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 3.0}  # ratio 2 inside: -r A_t
    assert dl.forward_backward([datum(advantages=adv, behavior=behavior)], "ppo", True, wide)[1]["loss:sum"] == \
        pytest.approx(-2.0 * sum(adv), rel=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_saved_state_resumes_bit_for_bit(tiny_model_dir, tmp_path, dtype):
    weights = [0, 0, 1, 1, 1]

    def step(dl: DatumLearner) -> list[float]:
        dl.forward_backward([datum(weights)], "cross_entropy")
        dl.optim_step(1e-2, 0.9, 0.95, 1e-8)
        return dl.forward_backward([datum(weights)], "cross_entropy", forward_only=True)[0][0]

    first = make(tiny_model_dir, dtype)
    step(first)
    first.save_state(str(tmp_path / "state"))
    after = step(first)
    resumed = make(tiny_model_dir, dtype)
    assert resumed.load_state(str(tmp_path / "state"), optimizer=True) == 1
    assert step(resumed) == after  # bitwise: the adapters and AdamW's moments came back
    fresh = make(tiny_model_dir, dtype)
    fresh.load_state(str(tmp_path / "state"), optimizer=False)
    assert step(fresh) != after  # AdamW started afresh: another update


def test_whole_modules_keep_their_rates_ratio_to_the_adapters(tiny_model_dir):
    # configs/grpo_lora.yaml's shape: the head trains whole beside the adapters at half their rate (modules_lr / lr).
    lora = LoraConfig(rank=4, modules_to_save=["lm_head"], modules_lr=5e-3)
    dl = DatumLearner(str(tiny_model_dir), LearnerConfig(lr=1e-2, warmup_steps=0, num_threads=2, lora=lora),
                      seed=0)
    dl.forward_backward([datum([0, 0, 1, 1, 1])], "cross_entropy")
    dl.optim_step(4e-4, 0.9, 0.95, 1e-8)
    assert sorted(g["lr"] for g in dl.learner.optimizer.param_groups) == pytest.approx([2e-4, 4e-4])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_datums_of_other_lengths_in_one_pass_are_each_the_datum_alone(tiny_model_dir, dtype):
    # Right-padded into passes (here several, at most 2 rows each): each datum's logprobs, loss and gradient are the
    # ones it has alone, within the dtype's noise; a malformed datum in a later pass changes no gradient.
    rows = [ROW, ROW[:4], [5, 9, 3, 3, 8, 1, 2, 7, 4], ROW[1:]]
    data = [Datum(r[:-1], r[1:], [1.0] * (len(r) - 1)) for r in rows]
    config = LearnerConfig(lr=1e-2, warmup_steps=0, num_threads=2, lora=LoraConfig(rank=4), micro_batch_size=2)
    dl = DatumLearner(str(tiny_model_dir), config, dtype=dtype, seed=0)
    together, metrics = dl.forward_backward(data, "cross_entropy")
    summed = grads(dl)
    tol = 1e-5 if dtype == "float32" else 2e-2
    alone_grads = None
    for d, got in zip(data, together, strict=True):
        dl.learner.optimizer.zero_grad(set_to_none=True)
        [alone], _ = dl.forward_backward([d], "cross_entropy")
        assert got == pytest.approx(alone, abs=tol)
        alone_grads = grads(dl) if alone_grads is None else [a + g for a, g in zip(alone_grads, grads(dl))]
    assert metrics["loss:sum"] == pytest.approx(-sum(sum(r) for r in together), abs=1e-3)
    for g1, g2 in zip(summed, alone_grads, strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-4 if dtype == "float32" else 5e-2,
                                   atol=1e-6 if dtype == "float32" else 5e-2)
    dl.learner.optimizer.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"a per-token input \(weights\) has 2 values"):
        dl.forward_backward([*data, Datum(ROW[:-1], ROW[1:], [1.0, 1.0])], "cross_entropy")
    assert not grads(dl)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("loss, policy_loss", [("ppo", "ppo"), ("importance_sampling", "ppo"), ("cispo", "cispo")])
def test_forward_backward_gives_relays_own_train_step_loss_and_gradients(tiny_model_dir, dtype, loss, policy_loss):
    # One batch two ways: relay's `Learner.train_step` (GRPO advantages r - group mean, packed passes with shared
    # prompts) and the datums a Tinker loop sends for it (the prompt and response, the same advantages on the
    # response's tokens, the sampler's logprobs: on policy, as after a weight sync). relay's `seq-mean-token-sum` is
    # the datums' summed loss over the B rows, so its loss and gradients are theirs / B.
    from learner.batch import TrainBatch
    from learner.learner import Learner

    config = LearnerConfig(lr=1e-2, warmup_steps=0, num_threads=2, lora=LoraConfig(rank=4), kl_coef=0.0,
                           advantage="grpo", group_scale="none", policy_loss=policy_loss,
                           loss_agg="seq-mean-token-sum", max_grad_norm=1e9)
    relay = Learner(str(tiny_model_dir), config, dtype=dtype, seed=0)
    tinker = DatumLearner(str(tiny_model_dir), config, dtype=dtype, seed=0)
    prompts = [[3, 7, 9], [3, 7, 9], [5, 4], [5, 4]]
    responses = [[4, 12, 5], [6, 1], [8, 8, 9, 1], [2]]
    rewards = [1.0, 0.0, 0.25, 1.0]
    behavior = relay.compute_logprobs(prompts, responses, temperature=1.0)
    recorded: dict[str, torch.Tensor] = {}
    relay.optimizer.register_step_pre_hook(  # the gradients relay steps with
        lambda *_: recorded.update({n: p.grad.clone() for n, p in relay.model.named_parameters()
                                    if p.grad is not None}))
    metrics = relay.train_step(TrainBatch(prompts, responses, behavior, rewards, group_size=2))
    advantages = [r - (rewards[i - i % 2] + rewards[i - i % 2 + 1]) / 2 for i, r in enumerate(rewards)]
    data = [Datum(p + r[:-1], p[1:] + r, advantages=[0.0] * (len(p) - 1) + [a] * len(r),
                  behavior_logprobs=[0.0] * (len(p) - 1) + list(b))
            for p, r, a, b in zip(prompts, responses, advantages, behavior, strict=True)]
    _, out = tinker.forward_backward(data, loss)
    if loss == "ppo":
        assert out["loss:sum"] / len(data) == pytest.approx(metrics["loss/policy"], rel=1e-5, abs=1e-6)
    theirs = {n: p.grad / len(data) for n, p in tinker.learner.model.named_parameters() if p.grad is not None}
    assert sorted(theirs) == sorted(recorded) and any(g.abs().sum() > 0 for g in theirs.values())
    for name, grad in recorded.items():
        torch.testing.assert_close(theirs[name], grad, rtol=1e-4 if dtype == "float32" else 5e-2,
                                   atol=1e-6 if dtype == "float32" else 5e-3, msg=name)
