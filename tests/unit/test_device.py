"""Device handling: `pick_device`, `to_cpu`, and the pure math creating its tensors on its inputs' device.

The math check runs on CPU inputs with torch's default device set to "meta": a tensor made without naming its device
lands there and can neither meet the inputs nor be read, so equal results mean every tensor followed the inputs (on a
GPU node the same tensor would have been a CPU tensor next to CUDA inputs)."""

from __future__ import annotations

import contextlib

import torch

from learner.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    distill_log_ratios,
    last_token_rewards,
    masked_whiten,
)
from learner.algo.logprobs import entropy_from_logits, logprobs_from_logits
from learner.algo.losses import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    kl,
    micro_batch_weight,
    value_loss,
)
from learner.passes.device import pick_device, to_cpu
from learner.passes.sequences import pad_per_token, pad_sequences, unpad_per_token


def test_pick_device_is_the_visible_gpu_else_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device() == torch.device("cuda:0")  # Ray's CUDA_VISIBLE_DEVICES makes the actor's GPU the first
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device() == torch.device("cpu")


def test_to_cpu_keeps_the_structure_and_does_not_copy_host_tensors():
    t = torch.arange(3)
    state = {"state": {0: {"step": t, "exp_avg": [t, (t, 2)]}}, "param_groups": [{"betas": (0.9, 0.99), "lr": 1e-3}]}
    out = to_cpu(state)
    assert out == state and out["state"][0]["step"] is t and isinstance(out["state"][0]["exp_avg"][1], tuple)


def math_inputs() -> dict[str, torch.Tensor]:
    """CPU inputs for `every_math_result`; B = 4 sequences, T = 4 positions, V = 5."""
    g = torch.Generator().manual_seed(0)
    logprobs, old, ref = (-torch.rand(4, 4, generator=g) for _ in range(3))
    return {"logprobs": logprobs, "old": old, "ref": ref, "values": torch.randn(4, 4, generator=g),
            "returns": torch.randn(4, 4, generator=g), "rewards": torch.tensor([1.0, 0.0, 0.5, 1.0]),
            "logits": torch.randn(2, 3, 5, generator=g), "labels": torch.tensor([[0, 1, 2], [3, 4, 0]]),
            "no_labels": torch.zeros(0, 3, dtype=torch.long)}


def every_math_result(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | float | list]:
    """Every registry entry and helper the learner calls, on `math_inputs`, including the branches that make new
    tensors (a group of one, a batch of one, no response tokens)."""
    batch = pad_sequences([[7, 8], [9], [4, 4, 4], [5]], [[3, 4, 1], [5], [2], [6, 6]])  # names its (host) device
    mask = batch.response_mask  # [4, 4]
    logprobs, old, ref, values, returns, rewards = (x[k] for k in ("logprobs", "old", "ref", "values", "returns",
                                                                   "rewards"))
    token_rewards = last_token_rewards(rewards, mask)
    out: dict[str, torch.Tensor | float | list] = {"token_rewards": token_rewards}
    out["no_tokens"] = last_token_rewards(rewards, mask[:, :0])
    distill = distill_log_ratios(ref, old, mask)
    out["distill/undiscounted"] = ADVANTAGE_ESTIMATORS["distill"](AdvantageInputs(token_rewards, mask, 1,
                                                                                  distill=distill)).advantages
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        for group_size in (1, 2) if name != "rloo" else (2,):
            result = estimator(AdvantageInputs(token_rewards, mask, group_size, values=values, gamma=0.9, lam=0.8,
                                               distill=distill, distill_discount=0.5))
            out[f"{name}/{group_size}"] = result.advantages
            if result.returns is not None:
                out[f"{name}/{group_size}/returns"] = result.returns
    one_sequence = AdvantageInputs(token_rewards[:1], mask[:1], 1)
    out["one_sequence"] = ADVANTAGE_ESTIMATORS["reinforce_pp"](one_sequence).advantages
    out["gae/empty"] = ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(token_rewards[:, :0], mask[:, :0], 2,
                                                                    values=values[:, :0])).advantages
    out["whiten/one_token"] = masked_whiten(values[:1], mask[1:2])
    for name, loss in POLICY_LOSSES.items():
        value, metrics = loss(logprobs, old, values, mask, 0.2, 0.28, None, "token-mean", 4)
        out[name] = value
        out.update({f"{name}/{key}": metric for key, metric in metrics.items()})
    out["ppo/dual"] = POLICY_LOSSES["ppo"](logprobs, old, values, mask, 0.2, 0.2, 3.0)[0]
    out["value_loss"] = value_loss(values, old, returns, mask, 0.2)[0]
    for estimator in KL_ESTIMATORS:
        out[f"kl/{estimator}"] = kl(logprobs, ref, estimator, mask)
    for mode in AGGREGATION_MODES:
        out[f"aggregate/{mode}"] = aggregate(values, mask, mode, 4)
        out[f"weight/{mode}"] = micro_batch_weight(mask[:2], mask, mode)
    out["logprobs"] = logprobs_from_logits(x["logits"], x["labels"])
    out["entropy"] = entropy_from_logits(x["logits"])
    out["logprobs/empty"] = logprobs_from_logits(x["logits"][:0], x["no_labels"])
    padded = pad_per_token([[0.1, 0.2, 0.3], [0.4], [0.5], [0.6, 0.7]], batch)
    out["padded"] = padded
    out["unpadded"] = unpad_per_token(padded, batch)
    return out


def test_the_math_makes_its_tensors_on_its_inputs_device():
    inputs = math_inputs()
    expected = every_math_result(inputs)
    with torch.device("meta"):
        got = every_math_result(inputs)
    assert got.keys() == expected.keys()
    for name, value in got.items():
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cpu" and torch.equal(value, expected[name]), name
        else:
            assert value == expected[name], name


def test_bfloat16_matmuls_in_float32_are_torchs_bfloat16_kernel_at_float32_speed(monkeypatch):
    """`matmuls_in` on a CPU without bfloat16 instructions: every matmul of the forward and the backward is float32
    on the bfloat16 inputs, rounded once, as torch's own kernel there (which sums in float32 too, in another
    order): the same values to a bfloat16 ulp, bit for bit on nearly all elements. On a CPU with them, or in float32:
    nothing."""
    from learner.passes import device

    monkeypatch.setattr(device, "_native_bfloat16", lambda: False)
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 48).to(torch.bfloat16)
    x = torch.randn(4, 16, 96, dtype=torch.bfloat16, requires_grad=True)
    a, b = torch.randn(3, 32, 40, dtype=torch.bfloat16), torch.randn(3, 40, 24, dtype=torch.bfloat16)

    def run():
        x.grad = layer.weight.grad = None
        out = layer(x)
        out.float().square().sum().backward()
        return out, x.grad, layer.weight.grad, a @ b, torch.baddbmm(a @ b, a, b), torch.addmm(a[0, :, :24], a[0], b[0])

    native = run()
    with device.matmuls_in(torch.device("cpu"), torch.bfloat16) as mode:
        assert isinstance(mode, device._Float32Matmuls)
        ours = run()
    for mine, theirs in zip(ours, native):
        assert mine.dtype == theirs.dtype == torch.bfloat16
        torch.testing.assert_close(mine, theirs, rtol=2**-7, atol=1e-2)  # a bfloat16 ulp
        assert (mine == theirs).float().mean() > 0.99
    assert torch.equal(ours[3], (a.float() @ b.float()).bfloat16())  # float32 products, rounded once
    big_a, big_b = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(512, 128, dtype=torch.bfloat16)
    with device.matmuls_in(torch.device("cpu"), torch.bfloat16):
        big = big_a @ big_b
    assert torch.equal(big, (big_a.float() @ big_b.float()).bfloat16())
    assert not torch.equal(big, big_a @ big_b)  # the mode computed it: torch's kernel sums in another order
    assert isinstance(device.matmuls_in(torch.device("cpu"), torch.float32), contextlib.nullcontext)
    monkeypatch.setattr(device, "_native_bfloat16", lambda: True)
    assert isinstance(device.matmuls_in(torch.device("cpu"), torch.bfloat16), contextlib.nullcontext)
    assert isinstance(device.matmuls_in(torch.device("cuda", 0), torch.bfloat16), contextlib.nullcontext)
